//! `[[api_keys]]` and `[[credentials]]`: the sections whose values are
//! secrets. Each secret comes from an environment variable or a file only
//! its owner may read, never from the configuration file, and is never
//! logged or shown in an error.

use std::path::{Path, PathBuf};

use iop_transport::environment::{Environment, read_secret};
use iop_transport::settings::{ConfigError, field_err, valid_name};
use serde::Deserialize;

use crate::catalog::model_matches;

/// One `[[api_keys]]` entry. The key itself comes from a file or the
/// environment, never from this file, and is never logged.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKeyEntry {
    /// Who this key belongs to.
    pub principal: String,
    /// Environment variable holding the key.
    #[serde(default)]
    pub key_env: Option<String>,
    /// File holding the key (first line).
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// Models the key may use; `["*"]` for all.
    #[serde(default = "all_models")]
    pub models: Vec<String>,
    /// May read `/status`.
    #[serde(default)]
    pub admin: bool,
    /// The key's id in limits, usage and logs (never the secret);
    /// default: `<principal>-<n>`, n its place among the principal's keys.
    #[serde(default)]
    pub id: Option<String>,
    /// The key's own limits (R-TEN-1; the principal's apply too).
    #[serde(default)]
    pub limits: super::tenants::LimitsEntry,
}

fn all_models() -> Vec<String> {
    vec!["*".into()]
}

/// One `[[credentials]]` entry: a managed credential profile. The secret
/// comes from the environment or a file, never from this file, and is never
/// logged.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CredentialEntry {
    /// Profile name providers refer to with `credential = "..."`.
    pub profile: String,
    /// Environment variable holding the secret.
    #[serde(default)]
    pub secret_env: Option<String>,
    /// File holding the secret (first line).
    #[serde(default)]
    pub secret_file: Option<PathBuf>,
    /// Revision; bump it when the secret is rotated.
    #[serde(default = "one")]
    pub revision: u64,
    /// A disabled profile's leases are refused by every Node.
    #[serde(default)]
    pub disabled: bool,
}

fn one() -> u64 {
    1
}

/// A validated managed credential profile.
#[derive(Clone)]
pub struct CredentialProfile {
    /// Profile name.
    pub profile: String,
    /// The secret (never logged: Debug is redacted).
    pub secret: zeroize::Zeroizing<Vec<u8>>,
    /// Current revision.
    pub revision: u64,
    /// False when disabled (or revoked at runtime).
    pub active: bool,
}

impl std::fmt::Debug for CredentialProfile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CredentialProfile")
            .field("profile", &self.profile)
            .field("secret", &"<redacted>")
            .field("revision", &self.revision)
            .field("active", &self.active)
            .finish()
    }
}

/// A validated API key.
#[derive(Clone)]
pub struct ApiKey {
    /// Principal.
    pub principal: String,
    /// The secret (never logged: Debug is redacted).
    pub key: String,
    /// Allowed models (`*` = all).
    pub models: Vec<String>,
    /// May read `/status`.
    pub admin: bool,
    /// The key's id (never the secret).
    pub id: String,
    /// The key's own limits.
    pub limits: iop_core::tenant::Limits,
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKey")
            .field("principal", &self.principal)
            .field("id", &self.id)
            .field("key", &"<redacted>")
            .field("models", &self.models)
            .finish()
    }
}

impl ApiKey {
    /// May this key use `model`?
    pub fn allows(&self, model: &str) -> bool {
        self.models.iter().any(|m| model_matches(m, model))
    }
}

/// The validated API keys, or the first field that is wrong.
pub(super) fn parse_api_keys(
    entries: &[ApiKeyEntry],
    base: &Path,
    env: &Environment,
) -> Result<Vec<ApiKey>, ConfigError> {
    let mut api_keys: Vec<ApiKey> = Vec::new();
    for (i, k) in entries.iter().enumerate() {
        let f = |name: &str| format!("api_keys[{i}].{name}");
        if k.principal.is_empty() {
            return Err(field_err(f("principal"), "must not be empty"));
        }
        // Errors name the field the key actually came from.
        let (key, source) = read_secret(
            env,
            k.key_env.as_deref(),
            k.key_file.as_deref(),
            base,
            ("key_env", "key_file"),
            &f,
        )?;
        let key: String = key.to_string();
        if key.len() < 16 {
            return Err(field_err(
                f(source),
                "the key must be at least 16 characters",
            ));
        }
        // Two entries with one key would silently share (or steal) a
        // principal; the error names the second entry, never the key.
        if let Some(first) = api_keys.iter().position(|a| a.key == key) {
            return Err(field_err(
                f(source),
                format!("the same key as api_keys[{first}]"),
            ));
        }
        let id = match &k.id {
            Some(id) if !valid_name(id) => {
                return Err(field_err(f("id"), "must be 1-128 chars of [A-Za-z0-9._-]"));
            }
            Some(id) => id.clone(),
            None => format!(
                "{}-{}",
                k.principal,
                api_keys
                    .iter()
                    .filter(|a| a.principal == k.principal)
                    .count()
                    + 1
            ),
        };
        if api_keys.iter().any(|a| a.id == id) {
            return Err(field_err(f("id"), format!("the key id {id} is used twice")));
        }
        api_keys.push(ApiKey {
            principal: k.principal.clone(),
            key,
            models: k.models.clone(),
            admin: k.admin,
            limits: k.limits.to_core(&f("limits"))?,
            id,
        });
    }
    Ok(api_keys)
}

/// The validated credential profiles, or the first field that is wrong.
pub(super) fn parse_credentials(
    entries: &[CredentialEntry],
    base: &Path,
    env: &Environment,
) -> Result<Vec<CredentialProfile>, ConfigError> {
    let mut out: Vec<CredentialProfile> = Vec::new();
    for (i, c) in entries.iter().enumerate() {
        let f = |name: &str| format!("credentials[{i}].{name}");
        if !valid_name(&c.profile) {
            return Err(field_err(
                f("profile"),
                "must be 1-128 chars of [A-Za-z0-9._-]",
            ));
        }
        if out.iter().any(|p| p.profile == c.profile) {
            return Err(field_err(
                f("profile"),
                format!("duplicate credential profile `{}`", c.profile),
            ));
        }
        let (secret, source) = read_secret(
            env,
            c.secret_env.as_deref(),
            c.secret_file.as_deref(),
            base,
            ("secret_env", "secret_file"),
            &f,
        )?;
        let secret = zeroize::Zeroizing::new(secret.as_bytes().to_vec());
        if secret.is_empty() || secret.len() > iop_core::cred::MAX_SECRET_BYTES {
            return Err(field_err(
                f(source),
                format!(
                    "the secret must be 1 to {} bytes",
                    iop_core::cred::MAX_SECRET_BYTES
                ),
            ));
        }
        if c.revision == 0 {
            return Err(field_err(f("revision"), "must be > 0"));
        }
        out.push(CredentialProfile {
            profile: c.profile.clone(),
            secret,
            revision: c.revision,
            active: !c.disabled,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EdgeConfig;
    use crate::config::fixture::{BASE, field_of, write_secret};
    use iop_transport::config_file::ConfigFile as _;

    #[test]
    fn a_secret_file_readable_by_others_or_its_group_is_refused() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k");
        write_secret(&path, "sk-team-key-0123456789\n");
        let parse_in = |extra: &str| EdgeConfig::parse(&format!("{BASE}{extra}"), dir.path());
        parse_in("[[api_keys]]\nprincipal='a'\nkey_file='k'\n").unwrap();
        // 0640 passes only when root owns the file: see
        // iop_transport::insecure_provided_secret_mode.
        for mode in [0o660, 0o604, 0o644] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = parse_in("[[api_keys]]\nprincipal='a'\nkey_file='k'\n").unwrap_err();
            assert!(e.to_string().contains("chmod 600"), "{e}");
            assert_eq!(field_of(e), "api_keys[0].key_file");
        }
    }

    #[test]
    fn credentials_are_validated_by_field_and_never_shown() {
        let dir = tempfile::tempdir().unwrap();
        write_secret(&dir.path().join("cred"), "sk-managed-secret\n");
        let parse_in = |extra: &str| EdgeConfig::parse(&format!("{BASE}{extra}"), dir.path());
        let c = parse_in(
            "[[credentials]]\nprofile='k'\nsecret_file='cred'\nrevision=3\n\
             [[providers]]\nid='a'\nnode='n'\nadapter='openai'\ntarget='t'\ncredential='k'\n",
        )
        .unwrap();
        assert_eq!(c.credentials[0].secret.as_slice(), b"sk-managed-secret");
        assert_eq!(c.credentials[0].revision, 3);
        assert!(c.credentials[0].active);
        assert!(!format!("{c:?}").contains("sk-managed-secret"));
        let e = parse_in(
            "[[providers]]\nid='a'\nnode='n'\nadapter='openai'\ntarget='t'\ncredential='ghost'\n",
        )
        .unwrap_err();
        assert_eq!(field_of(e), "providers[0].credential");
        let e = parse_in("[[credentials]]\nprofile='k'\n").unwrap_err();
        assert_eq!(field_of(e), "credentials[0].secret_env");
        let e = parse_in("[[credentials]]\nprofile='k'\nsecret_file='cred'\nsecret_env='X'\n")
            .unwrap_err();
        assert_eq!(field_of(e), "credentials[0].secret_env");
        let e = parse_in("[[credentials]]\nprofile='k'\nsecret_file='missing'\n").unwrap_err();
        assert_eq!(field_of(e), "credentials[0].secret_file");
        let e = parse_in(
            "[[credentials]]\nprofile='k'\nsecret_file='cred'\n[[credentials]]\nprofile='k'\nsecret_file='cred'\n",
        )
        .unwrap_err();
        assert_eq!(field_of(e), "credentials[1].profile");
        let c =
            parse_in("[[credentials]]\nprofile='k'\nsecret_file='cred'\ndisabled=true\n").unwrap();
        assert!(!c.credentials[0].active);
    }

    #[test]
    fn api_key_errors_name_the_field_used_and_duplicates_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        write_secret(&dir.path().join("short"), "too-short\n");
        write_secret(&dir.path().join("k1"), "sk-first-key-0123456789\n");
        write_secret(&dir.path().join("k2"), "sk-first-key-0123456789\n");
        let parse_in = |extra: &str| EdgeConfig::parse(&format!("{BASE}{extra}"), dir.path());
        let e = parse_in("[[api_keys]]\nprincipal='a'\nkey_file='short'\n").unwrap_err();
        assert_eq!(field_of(e), "api_keys[0].key_file");
        let e = parse_in("[[api_keys]]\nprincipal='a'\nkey_file='missing'\n").unwrap_err();
        assert_eq!(field_of(e), "api_keys[0].key_file");
        let e = parse_in(
            "[[api_keys]]\nprincipal='a'\nkey_file='k1'\n\
             [[api_keys]]\nprincipal='b'\nkey_file='k2'\n",
        )
        .unwrap_err();
        let text = e.to_string();
        assert!(
            !text.contains("sk-first-key"),
            "the key is never shown: {text}"
        );
        assert_eq!(field_of(e), "api_keys[1].key_file");
        write_secret(&dir.path().join("tiny"), "\n");
        let e = parse_in("[[credentials]]\nprofile='k'\nsecret_file='tiny'\n").unwrap_err();
        assert_eq!(field_of(e), "credentials[0].secret_file");
    }

    #[test]
    fn api_key_debug_never_shows_the_key() {
        let k = ApiKey {
            principal: "p".into(),
            key: "sk-secret-secret-secret".into(),
            models: vec![],
            admin: false,
            id: "p-1".into(),
            limits: iop_core::tenant::Limits::default(),
        };
        assert!(!format!("{k:?}").contains("secret-secret"));
    }
}
