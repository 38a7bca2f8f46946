//! `[runtime]`: the async runtime a binary runs on, shared by the Edge and
//! the Node.
//!
//! By default each process runs tokio's multi-thread runtime with one
//! worker thread per CPU, so tasks move between threads: a request's
//! hand-offs between tasks (docs/benchmarks.md, "Hops on one request's
//! path") may each wake another thread. `worker_threads = 1` runs every
//! task on the one thread that started the process (tokio's current-thread
//! runtime; quinn's endpoint and connections run on it too), so a hand-off
//! is a queue push on the same thread; blocking work (the embedded store's
//! file, the metrics exporter's shutdown) still goes to tokio's blocking
//! pool. Any other number sets the multi-thread runtime's workers.

use serde::Deserialize;

use crate::settings::{ConfigError, field_err};

/// The most worker threads `[runtime] worker_threads` accepts.
pub const MAX_WORKER_THREADS: usize = 1024;

/// `[runtime]`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RuntimeSection {
    /// `0` (the default): the multi-thread runtime, one worker per CPU;
    /// `1`: the current-thread runtime, every task on the main thread;
    /// `N`: the multi-thread runtime with `N` workers.
    pub worker_threads: usize,
}

/// The runtime a [`RuntimeSection`] asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuntimeFlavor {
    /// Multi-thread, one worker per CPU.
    PerCpu,
    /// Current-thread: every task on the thread that calls `block_on`.
    CurrentThread,
    /// Multi-thread with this many workers (2 or more).
    Workers(usize),
}

impl RuntimeSection {
    /// Validate, naming `section.worker_threads`.
    pub fn validate(&self, section: &str) -> Result<(), ConfigError> {
        if self.worker_threads > MAX_WORKER_THREADS {
            return Err(field_err(
                format!("{section}.worker_threads"),
                format!(
                    "must be 0 (one per CPU), 1 (one thread for every task) or at most {MAX_WORKER_THREADS}"
                ),
            ));
        }
        Ok(())
    }

    /// Which runtime this section asks for.
    pub fn flavor(&self) -> RuntimeFlavor {
        match self.worker_threads {
            0 => RuntimeFlavor::PerCpu,
            1 => RuntimeFlavor::CurrentThread,
            n => RuntimeFlavor::Workers(n),
        }
    }

    /// Build the runtime (every driver enabled: I/O and time).
    pub fn build(&self) -> std::io::Result<tokio::runtime::Runtime> {
        let mut builder = match self.flavor() {
            RuntimeFlavor::PerCpu => tokio::runtime::Builder::new_multi_thread(),
            RuntimeFlavor::CurrentThread => tokio::runtime::Builder::new_current_thread(),
            RuntimeFlavor::Workers(n) => {
                let mut b = tokio::runtime::Builder::new_multi_thread();
                b.worker_threads(n);
                b
            }
        };
        builder.enable_all().build()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_threads_pick_the_runtime_and_too_many_is_refused_by_name() {
        let section = |n| RuntimeSection { worker_threads: n };
        assert_eq!(RuntimeSection::default().flavor(), RuntimeFlavor::PerCpu);
        assert_eq!(section(1).flavor(), RuntimeFlavor::CurrentThread);
        assert_eq!(section(3).flavor(), RuntimeFlavor::Workers(3));
        assert!(section(MAX_WORKER_THREADS).validate("runtime").is_ok());
        let e = section(MAX_WORKER_THREADS + 1)
            .validate("runtime")
            .unwrap_err()
            .to_string();
        assert!(e.contains("`runtime.worker_threads`"), "{e}");
    }

    #[test]
    fn each_flavor_builds_a_runtime_that_runs_tasks_and_timers() {
        for n in [0, 1, 2] {
            let rt = RuntimeSection { worker_threads: n }.build().unwrap();
            let answer = rt.block_on(async {
                let task = tokio::spawn(async {
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                    tokio::task::spawn_blocking(|| 42).await.unwrap()
                });
                task.await.unwrap()
            });
            assert_eq!(answer, 42, "worker_threads = {n}");
        }
    }
}
