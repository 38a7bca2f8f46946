//! What the configuration's tests share: a minimal valid file and helpers
//! to parse it with more sections and to read the field an error names.

use std::path::Path;

use iop_transport::config_file::ConfigFile as _;
use iop_transport::environment::Environment;
use iop_transport::settings::ConfigError;

use super::EdgeConfig;

/// The smallest valid file: `[edge]` and `[tls]`.
pub(super) const BASE: &str = r#"
[edge]
state_dir = "state"
[tls]
ca = "ca.pem"
cert = "edge.pem"
key = "edge.key"
"#;

/// [`BASE`] and `extra`, parsed with paths relative to `/etc/iop` and an
/// empty environment.
pub(super) fn parse(extra: &str) -> Result<EdgeConfig, ConfigError> {
    EdgeConfig::parse_in(
        &format!("{BASE}{extra}"),
        Path::new("/etc/iop"),
        &Environment::default(),
    )
}

/// A secret file as an operator must write it: mode 0600.
pub(super) fn write_secret(path: &Path, text: &str) {
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .unwrap();
    std::io::Write::write_all(&mut file, text.as_bytes()).unwrap();
}

/// The field a field error names (any other error fails the test).
pub(super) fn field_of(e: ConfigError) -> String {
    match e {
        ConfigError::Field { field, .. } => field,
        other => panic!("expected a field error, got {other}"),
    }
}
