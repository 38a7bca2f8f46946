//! Recording a simulated world: the determinism hash over every core input
//! and output, and the capture of one machine's trace.
//!
//! Every core machine the world builds gets a [`Tap`] from the
//! [`Recorder`]. With hashing on, each trace line of every machine (tagged
//! with the machine's instance number) and each client-visible delivery is
//! fed into one SHA-256: two runs of a seed are deterministic exactly when
//! their hashes match. With a [`Capture`], the chosen machine instance also
//! writes its trace file.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::{Arc, Mutex, PoisonError};

use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::trace::{MachineKind, Tap, TraceSink, TraceWriter};

/// Which machine instance to write a trace of, and where.
pub struct Capture {
    /// The machine kind.
    pub machine: MachineKind,
    /// Which instance of that kind, counting from 0 in creation order (the
    /// Edge's dispatcher of its n-th incarnation, the n-th node connection,
    /// the n-th request machine, ...). Heartbeats live inside the
    /// connection machines, whose traces carry them.
    pub instance: u64,
    /// Where the trace goes.
    pub writer: Box<dyn Write + Send>,
}

impl std::fmt::Debug for Capture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Capture")
            .field("machine", &self.machine)
            .field("instance", &self.instance)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Default)]
struct Journal {
    sha: Sha256,
    lines: u64,
}

struct JournalSink {
    id: u64,
    journal: Arc<Mutex<Journal>>,
}

impl TraceSink for JournalSink {
    fn line(&mut self, line: &str) {
        let mut j = self.journal.lock().unwrap_or_else(PoisonError::into_inner);
        j.sha.update(self.id.to_le_bytes());
        j.sha.update(line.as_bytes());
        j.sha.update(b"\n");
        j.lines += 1;
    }
}

/// Hands out taps and keeps the determinism hash.
pub(crate) struct Recorder {
    journal: Option<Arc<Mutex<Journal>>>,
    capture: Option<Capture>,
    per_kind: BTreeMap<MachineKind, u64>,
    next_id: u64,
}

impl Recorder {
    pub(crate) fn new(hash: bool, capture: Option<Capture>) -> Self {
        Self {
            journal: hash.then(|| Arc::new(Mutex::new(Journal::default()))),
            capture,
            per_kind: BTreeMap::new(),
            next_id: 1,
        }
    }

    /// A tap for a new machine of `kind` built from `config`.
    pub(crate) fn tap(&mut self, kind: MachineKind, config: &impl Serialize) -> Tap {
        let id = self.next_id;
        self.next_id += 1;
        let index = self.per_kind.entry(kind).or_insert(0);
        let this = *index;
        *index += 1;
        let mut tap = Tap::off();
        if let Some(journal) = &self.journal {
            // The config is part of the hashed input.
            let mut sink = JournalSink {
                id,
                journal: Arc::clone(journal),
            };
            let header = serde_json::json!({"machine": kind.as_str(), "config": config});
            sink.line(&header.to_string());
            tap.add(Box::new(sink));
        }
        if self
            .capture
            .as_ref()
            .is_some_and(|c| c.machine == kind && c.instance == this)
            && let Some(capture) = self.capture.take()
        {
            tap.add(Box::new(TraceWriter::new(capture.writer, kind, config)));
        }
        tap
    }

    /// Hash one world-level line (a client-visible delivery).
    pub(crate) fn world_line(&mut self, line: &impl Serialize) {
        if let Some(journal) = &self.journal {
            let mut sink = JournalSink {
                id: 0,
                journal: Arc::clone(journal),
            };
            sink.line(&serde_json::to_string(line).unwrap_or_default());
        }
    }

    /// The hash so far (hex) and the number of lines hashed.
    pub(crate) fn digest(&self) -> Option<(String, u64)> {
        let journal = self.journal.as_ref()?;
        let j = journal.lock().unwrap_or_else(PoisonError::into_inner);
        let bytes = j.sha.clone().finalize();
        let hex = bytes.iter().map(|b| format!("{b:02x}")).collect::<String>();
        Some((hex, j.lines))
    }
}
