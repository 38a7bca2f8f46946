//! What the node's process tests share.
#![allow(dead_code)]

/// Write a secret file as an administrator would (mode 0600).
pub(crate) fn write_secret(path: &std::path::Path, text: &str) {
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .expect("secret file");
    std::io::Write::write_all(&mut file, text.as_bytes()).expect("secret written");
}

/// Send `sig` (`-STOP`, `-CONT`, ...) to a running child process.
pub(crate) fn signal(child: &tokio::process::Child, sig: &str) {
    let pid = child.id().expect("running").to_string();
    let status = std::process::Command::new("kill")
        .args([sig, &pid])
        .status()
        .expect("kill");
    assert!(status.success(), "kill {sig} {pid}");
}
