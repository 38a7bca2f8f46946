//! The trace files of a process: which machines it records
//! (`--record-trace FILE`, `--trace-machine KIND`) and where each
//! machine's trace goes.
//!
//! One file per machine instance, named after the base path, the kind and
//! the instance's number in creation order (`FILE.edge-request.7`), so a
//! trace holds one machine and [`crate::replay`] reads it as it is. A
//! shell may name one kind's files itself ([`TraceFiles::tap_at`]): the
//! Edge writes its dispatcher's trace to `FILE`, the node each
//! connection's to `FILE.<n>`.

use std::collections::BTreeSet;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

use crate::{MachineKind, Tap, TraceWriter};

/// Which machines a process records, and where.
#[derive(Debug)]
pub struct TraceFiles {
    base: PathBuf,
    kinds: BTreeSet<MachineKind>,
    /// Instances of each kind so far, by [`MachineKind::ALL`]'s order.
    counts: [AtomicU64; MachineKind::ALL.len()],
}

impl TraceFiles {
    /// Record the machines of `kinds` to files named after `base`.
    pub fn new(base: PathBuf, kinds: impl IntoIterator<Item = MachineKind>) -> Self {
        Self {
            base,
            kinds: kinds.into_iter().collect(),
            counts: Default::default(),
        }
    }

    /// Record nothing.
    pub fn off() -> Self {
        Self::new(PathBuf::new(), [])
    }

    /// The base path.
    pub fn base(&self) -> &Path {
        &self.base
    }

    /// Whether machines of `kind` are recorded (check before building a
    /// config record nobody reads).
    pub fn records(&self, kind: MachineKind) -> bool {
        self.kinds.contains(&kind)
    }

    /// The number of the next machine of `kind`, from 1.
    pub fn next_instance(&self, kind: MachineKind) -> u64 {
        let at = MachineKind::ALL
            .iter()
            .position(|k| *k == kind)
            .unwrap_or_default();
        self.counts[at].fetch_add(1, Ordering::Relaxed) + 1
    }

    /// A tap for a new machine of `kind` built from `config()` (called
    /// only when recording), writing `<base>.<kind>.<n>`; [`Tap::off`]
    /// when `kind` is not recorded.
    pub fn tap<C: Serialize>(
        &self,
        kind: MachineKind,
        config: impl FnOnce() -> C,
    ) -> std::io::Result<Tap> {
        if !self.records(kind) {
            return Ok(Tap::off());
        }
        let n = self.next_instance(kind);
        let path = PathBuf::from(format!("{}.{}.{n}", self.base.display(), kind.as_str()));
        Self::tap_at(&path, kind, &config())
    }

    /// A tap writing the trace of a machine of `kind` built from `config`
    /// to `path`.
    pub fn tap_at(path: &Path, kind: MachineKind, config: &impl Serialize) -> std::io::Result<Tap> {
        let file = std::fs::File::create(path)?;
        Ok(Tap::to(TraceWriter::new(
            BufWriter::new(file),
            kind,
            config,
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{HeartbeatConfigRec, TraceReader, replay};
    use iop_core::Instant;
    use iop_core::liveness::heartbeat::{HeartbeatConfig, HeartbeatInput};
    use std::time::Duration;

    #[test]
    fn each_recorded_machine_gets_its_own_numbered_file_and_replays() {
        let dir = std::env::temp_dir().join(format!("iop-trace-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let files = TraceFiles::new(dir.join("t"), [MachineKind::Heartbeat]);
        assert!(!files.records(MachineKind::EdgeRequest));
        let off = files
            .tap(MachineKind::EdgeRequest, || ())
            .expect("an unrecorded kind opens nothing");
        assert!(!off.is_on());
        let rec = HeartbeatConfigRec {
            config: HeartbeatConfig {
                interval: Duration::from_millis(100),
                wait: Duration::from_millis(150),
            },
            created_us: 0,
        };
        for _ in 0..2 {
            let tap = files.tap(MachineKind::Heartbeat, || rec).expect("file");
            let mut hb = crate::Driven::new(rec.build(), tap);
            let mut outs = 0;
            hb.handle_input(Instant::from_millis(1), HeartbeatInput::Pong { seq: 1 });
            for t in [100, 250, 400] {
                if hb.fire_due(Instant::from_millis(t)) {
                    hb.drain(Instant::from_millis(t), |_| outs += 1);
                }
            }
            assert!(outs > 0);
        }
        for n in [1, 2] {
            let path = dir.join(format!("t.heartbeat.{n}"));
            let text = std::fs::read_to_string(&path).expect("trace written");
            let report =
                replay(TraceReader::new(text.as_bytes()).expect("header")).expect("replays");
            assert_eq!(report.machine, MachineKind::Heartbeat);
            assert!(report.checked > 0, "{text}");
        }
        assert!(!dir.join("t.heartbeat.3").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
