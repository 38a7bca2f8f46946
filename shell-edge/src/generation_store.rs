//! Persistence of the generation high-water mark (R-GEN-1 across restarts).
//!
//! The floor a new process starts from is the core's rule
//! ([`iop_core::edge::generations::restart_floor`]: the larger of the
//! persisted mark and the wall clock); this file reads and writes the mark.

use std::io::Write;
use std::path::{Path, PathBuf};

use iop_core::edge::generations::restart_floor;

/// Where the mark lives.
#[derive(Debug, Clone)]
pub struct GenerationStore {
    path: PathBuf,
}

impl GenerationStore {
    /// A store in `state_dir` (created if missing).
    pub fn open(state_dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(state_dir)?;
        Ok(Self {
            path: state_dir.join("generation"),
        })
    }

    /// The floor for a new process.
    pub fn floor(&self, unix_ms: u64) -> std::io::Result<u64> {
        let persisted = match std::fs::read_to_string(&self.path) {
            Ok(text) => text.trim().parse::<u64>().map_err(|e| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{}: {e}", self.path.display()),
                )
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
            Err(e) => return Err(e),
        };
        // R-GEN-1 across restarts: the core's rule; a refusal names the file.
        restart_floor(persisted, unix_ms).map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{}: {e}", self.path.display()),
            )
        })
    }

    /// Persist `high_water` durably: write a temp file, fsync it, rename it
    /// over the mark, then fsync the directory so the rename survives a
    /// crash too (R-GEN-1 across restarts).
    pub fn save(&self, high_water: u64) -> std::io::Result<()> {
        let tmp = self.path.with_extension("tmp");
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(format!("{high_water}\n").as_bytes())?;
        file.sync_all()?;
        drop(file);
        std::fs::rename(&tmp, &self.path)?;
        if let Some(dir) = self.path.parent() {
            // Directories cannot be opened for syncing on every platform;
            // where they can, a failure is an error.
            if let Ok(dir) = std::fs::File::open(dir) {
                dir.sync_all()?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use iop_core::edge::registry::GENERATION_LIMIT;

    use super::*;

    #[test]
    fn floor_is_the_larger_of_persisted_and_wall_time() {
        let dir = std::env::temp_dir().join(format!("iop-genstore-{}", std::process::id()));
        let store = GenerationStore::open(&dir).unwrap();
        assert_eq!(store.floor(5).unwrap(), 5);
        store.save(1_000).unwrap();
        assert_eq!(store.floor(5).unwrap(), 1_000);
        assert_eq!(store.floor(2_000).unwrap(), 2_000);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_mark_at_the_generation_limit_refuses_to_start() {
        let dir = tempfile::tempdir().unwrap();
        let store = GenerationStore::open(dir.path()).unwrap();
        store.save(GENERATION_LIMIT - 1).unwrap();
        assert_eq!(store.floor(5).unwrap(), GENERATION_LIMIT - 1);
        for corrupt in [GENERATION_LIMIT, u64::MAX] {
            store.save(corrupt).unwrap();
            let e = store.floor(5).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
            assert!(e.to_string().contains("generation"), "{e}");
        }
        assert!(
            !dir.path().join("generation.tmp").exists(),
            "the temp file was renamed"
        );
    }
}
