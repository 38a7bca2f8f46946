//! Persistence of the generation high-water mark (R-GEN-1 across restarts).
//!
//! The floor handed to the core is the larger of the persisted mark and the
//! current Unix time in milliseconds, so generations keep increasing across
//! restarts even if the state file is lost (as long as the clock does not
//! jump back), and across clock jumps as long as the file survives.

use std::path::{Path, PathBuf};

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
        Ok(persisted.max(unix_ms))
    }

    /// Persist `high_water` (write to a temp file, then rename).
    pub fn save(&self, high_water: u64) -> std::io::Result<()> {
        let tmp = self.path.with_extension("tmp");
        std::fs::write(&tmp, format!("{high_water}\n"))?;
        std::fs::rename(&tmp, &self.path)
    }
}

#[cfg(test)]
mod tests {
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
}
