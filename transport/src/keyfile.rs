//! Secret key files (mode 0600): the Node's lease recipient key and the
//! Edge's lease signing key. Never logs key bytes.

use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
#[cfg(test)]
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use zeroize::Zeroizing;

/// Read the 32-byte key at `path`, or create it with `generate` (mode 0600,
/// created exclusively). An existing file whose mode grants anything to the
/// group or others is refused: the process must not start with a key other
/// users could have read.
pub fn load_or_create(
    path: &Path,
    generate: impl FnOnce() -> Zeroizing<[u8; 32]>,
) -> std::io::Result<Zeroizing<Vec<u8>>> {
    match std::fs::File::open(path) {
        Ok(mut file) => {
            if let Some(mode) = crate::insecure_secret_file_mode(path)? {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    format!(
                        "{} has mode {mode:o}; a key file must be mode 0600 or stricter",
                        path.display()
                    ),
                ));
            }
            let mut bytes = Zeroizing::new(Vec::with_capacity(33));
            Read::by_ref(&mut file).take(33).read_to_end(&mut bytes)?;
            if bytes.len() != 32 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{} must hold exactly 32 bytes", path.display()),
                ));
            }
            Ok(bytes)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            let key = generate();
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(path)?;
            file.write_all(key.as_slice())?;
            file.sync_all()?;
            Ok(Zeroizing::new(key.to_vec()))
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn creates_0600_then_loads_and_refuses_wider_modes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k.key");
        let a = load_or_create(&path, || Zeroizing::new([7; 32])).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let b = load_or_create(&path, || Zeroizing::new([9; 32])).unwrap();
        assert_eq!(a, b);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(load_or_create(&path, || Zeroizing::new([9; 32])).is_err());
    }
}
