//! Bugs planted in the core machines themselves (`iop-core`'s test-only
//! feature `planted-bugs`, see `iop_core::planted`), switched on in every
//! machine of the kind the world creates.
//!
//! The simulator's own library does not need the feature: a [`CoreBugs`]
//! carries the calls that switch a bug on as closures, built by whoever has
//! the feature — the `iop-sim` binary built with `--features planted-bugs`
//! (`--core-bug NAME`), and `cargo test -p iop-sim`, whose dev-dependency
//! turns the feature on. The names go into the reproduction command.

use std::fmt;
use std::sync::Arc;

use iop_core::edge::dispatch::Dispatcher;
use iop_core::edge::request::Request;
use iop_core::node::watchdog::Watchdog;
use iop_core::tenant::Tenants;

type DispatcherHook = Arc<dyn Fn(&Dispatcher) + Send + Sync>;
type WatchdogHook = Arc<dyn Fn(&Watchdog) + Send + Sync>;
type RequestHook = Arc<dyn Fn(&Request) + Send + Sync>;
type ThreadHook = Arc<dyn Fn(bool) + Send + Sync>;
type TenantsHook = Arc<dyn Fn(&Tenants) + Send + Sync>;

/// Planted core bugs: their names and the calls that switch them on in each
/// new dispatcher, watchdog and request machine, or for the world's thread.
/// Empty by default.
#[derive(Clone, Default)]
pub struct CoreBugs {
    names: Vec<&'static str>,
    dispatcher: Vec<DispatcherHook>,
    watchdog: Vec<WatchdogHook>,
    request: Vec<RequestHook>,
    thread: Vec<ThreadHook>,
    tenants: Vec<TenantsHook>,
}

impl CoreBugs {
    /// No planted core bug.
    pub fn none() -> Self {
        Self::default()
    }

    /// Add a bug by name (`iop_core::planted::PlantedBug::as_str`) with the
    /// calls that plant it in a dispatcher, a watchdog and a request machine
    /// (`plant` on any of them forwards to the machines the bug lives in; on
    /// the others it changes nothing).
    pub fn with(
        mut self,
        name: &'static str,
        dispatcher: impl Fn(&Dispatcher) + Send + Sync + 'static,
        watchdog: impl Fn(&Watchdog) + Send + Sync + 'static,
        request: impl Fn(&Request) + Send + Sync + 'static,
    ) -> Self {
        self.names.push(name);
        self.dispatcher.push(Arc::new(dispatcher));
        self.watchdog.push(Arc::new(watchdog));
        self.request.push(Arc::new(request));
        self
    }

    /// Add a bug by name that is planted for the world's thread rather than
    /// in a machine (`iop_core::planted::plant_in_thread`: the journal's
    /// rules and the publisher of durable responses). `switch(true)` plants
    /// it when the world is built, `switch(false)` clears the thread's set
    /// when the world is dropped.
    pub fn with_thread_scope(
        mut self,
        name: &'static str,
        switch: impl Fn(bool) + Send + Sync + 'static,
    ) -> Self {
        self.names.push(name);
        self.thread.push(Arc::new(switch));
        self
    }

    /// Add a bug by name that lives in the tenants' machine (SPEC §9), with
    /// the call that plants it in each Edge process's `Tenants`.
    pub fn with_tenants(
        mut self,
        name: &'static str,
        tenants: impl Fn(&Tenants) + Send + Sync + 'static,
    ) -> Self {
        self.names.push(name);
        self.tenants.push(Arc::new(tenants));
        self
    }

    /// Plant `bug` (only with the feature, which the caller must have).
    #[cfg(feature = "planted-bugs")]
    pub fn plant(self, bug: iop_core::planted::PlantedBug) -> Self {
        use iop_core::planted;
        if bug.in_thread_scope() {
            return self.with_thread_scope(bug.as_str(), move |on| {
                if on {
                    planted::plant_in_thread(bug);
                } else {
                    planted::clear_thread();
                }
            });
        }
        if bug.in_tenants_machine() {
            return self.with_tenants(bug.as_str(), move |t| t.plant(bug));
        }
        self.with(
            bug.as_str(),
            move |d| d.plant(bug),
            move |w| w.plant(bug),
            move |r| r.plant(bug),
        )
    }

    /// The planted bugs' names, in the order they were added.
    pub fn names(&self) -> &[&'static str] {
        &self.names
    }

    /// Whether nothing is planted.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// The command-line flags that plant these bugs again.
    pub fn flags(&self) -> String {
        self.names
            .iter()
            .map(|n| format!(" --core-bug {n}"))
            .collect()
    }

    /// Switch the bugs on in a dispatcher the world just created.
    pub(crate) fn plant_dispatcher(&self, dispatcher: &Dispatcher) {
        for hook in &self.dispatcher {
            hook(dispatcher);
        }
    }

    /// Switch the bugs on in a request machine the world just created.
    pub(crate) fn plant_request(&self, request: &Request) {
        for hook in &self.request {
            hook(request);
        }
    }

    /// Switch the bugs on in a tenants' machine the world just created.
    pub(crate) fn plant_tenants(&self, tenants: &Tenants) {
        for hook in &self.tenants {
            hook(tenants);
        }
    }

    /// Switch the thread-scoped bugs on for the world being built.
    pub(crate) fn plant_thread(&self) {
        for hook in &self.thread {
            hook(true);
        }
    }

    /// Switch the thread-scoped bugs off again (the world is dropped).
    pub(crate) fn clear_thread(&self) {
        for hook in &self.thread {
            hook(false);
        }
    }

    /// Switch the bugs on in a watchdog the world just created.
    pub(crate) fn plant_watchdog(&self, watchdog: &Watchdog) {
        for hook in &self.watchdog {
            hook(watchdog);
        }
    }
}

impl fmt::Debug for CoreBugs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("CoreBugs").field(&self.names).finish()
    }
}
