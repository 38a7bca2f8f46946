//! The environment as a configuration input, the way containers, systemd
//! units and Kubernetes pass it: a snapshot of the process environment,
//! the overlay of `<PREFIX>__<SECTION>__<FIELD>` variables onto the TOML
//! document before it is deserialized, and the secrets that `*_env`
//! fields name.
//!
//! # The rule
//!
//! With the prefix `IOP_EDGE`, the variable
//! `IOP_EDGE__EDGE__MAX_CONNECTIONS=8192` sets `[edge] max_connections`:
//!
//! 1. After the prefix, `__` separates the path's segments. A segment is a
//!    key, lower-cased (`MAX_CONNECTIONS` is `max_connections`), or a run
//!    of digits, an index into an array of tables:
//!    `IOP_NODE__PROVIDERS__0__BASE_URL` is `base_url` of the first
//!    `[[providers]]`. An index one past the end appends an entry; entries
//!    are numbered from 0 without gaps.
//! 2. The value is read as a TOML value (`8192`, `true`, `0.5`,
//!    `["a:7443", "b:7443"]`, `{ model = "m" }`, `"text"`); a value that is
//!    not one (`0.0.0.0:7443`, `/var/lib/iop`, `nats`) is a string. A
//!    number or boolean given to a field that takes text is taken as its
//!    text (`IOP_EDGE__EDGE__EDGE_ID=7` is the id `"7"`).
//! 3. Variables apply after the file, shortest path first, so a whole
//!    value (an array, a table) can be set and then refined by deeper
//!    variables.
//! 4. A variable naming a field that does not exist is refused like an
//!    unknown field in the file, and every error about a value that came
//!    from the environment names the variable.
//!
//! Keys of free-form maps (`[discovered_models] rename`) keep their case
//! and may hold characters variable names cannot: set such a map whole,
//! as an inline table.
//!
//! Secrets never come from this overlay: a configuration names the
//! variable (`key_env`) or the file (`key_file`) that holds each secret,
//! and [`Environment::var`] reads such variables from the same snapshot.

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::path::Path;

use serde::de::DeserializeOwned;
use toml::Value;
use zeroize::Zeroizing;

use crate::settings::{ConfigError, field_err};

/// Separator of the path segments in a variable's name.
pub const SEGMENT_SEPARATOR: &str = "__";

/// The largest array index a variable may name: arrays grow one entry per
/// variable, so this bounds nothing but a typo's reach.
pub const MAX_INDEX: usize = 65_535;

/// A snapshot of the environment a configuration is loaded with.
///
/// Tests build one from pairs, so loading a configuration never depends
/// on (or changes) the process environment.
#[derive(Clone, Default)]
pub struct Environment {
    vars: BTreeMap<String, String>,
    /// Names whose value is not UTF-8 (such a variable reads as unset, and
    /// an overlay variable among them is refused).
    not_unicode: Vec<String>,
}

impl std::fmt::Debug for Environment {
    // Values may be secrets: only the names are shown.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Environment")
            .field("names", &self.vars.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Environment {
    /// The process environment, now.
    pub fn from_process() -> Self {
        let mut env = Self::default();
        for (name, value) in std::env::vars_os() {
            let Ok(name) = name.into_string() else {
                continue;
            };
            match value.into_string() {
                Ok(value) => {
                    env.vars.insert(name, value);
                }
                Err(_) => env.not_unicode.push(name),
            }
        }
        env
    }

    /// An environment of exactly these variables.
    pub fn from_pairs<I, K, V>(pairs: I) -> Self
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        Self {
            vars: pairs
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
            not_unicode: Vec::new(),
        }
    }

    /// A variable's value (`None` when unset or not UTF-8).
    pub fn var(&self, name: &str) -> Option<&str> {
        self.vars.get(name).map(String::as_str)
    }

    /// The variables under `prefix` (`IOP_EDGE` takes `IOP_EDGE__*`), parsed,
    /// parents before children and lower indices first.
    fn settings(&self, prefix: &str) -> Result<Vec<Setting>, ConfigError> {
        let head = format!("{prefix}{SEGMENT_SEPARATOR}");
        if let Some(name) = self.not_unicode.iter().find(|n| n.starts_with(&head)) {
            return Err(env_err(name, "the value is not valid UTF-8"));
        }
        let mut settings = Vec::new();
        for (name, raw) in self.vars.range(head.clone()..) {
            let Some(rest) = name.strip_prefix(&head) else {
                break;
            };
            settings.push(Setting::parse(name, rest, raw)?);
        }
        settings.sort_by(|a, b| compare_paths(&a.path, &b.path));
        Ok(settings)
    }
}

/// One segment of a field's path.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Key(String),
    Index(usize),
}

/// Parents first (a prefix sorts before its extensions), indices in
/// numeric order.
fn compare_paths(a: &[Segment], b: &[Segment]) -> Ordering {
    for (x, y) in a.iter().zip(b) {
        let order = match (x, y) {
            (Segment::Index(i), Segment::Index(j)) => i.cmp(j),
            (Segment::Key(k), Segment::Key(l)) => k.cmp(l),
            (Segment::Index(_), Segment::Key(_)) => Ordering::Less,
            (Segment::Key(_), Segment::Index(_)) => Ordering::Greater,
        };
        if order != Ordering::Equal {
            return order;
        }
    }
    a.len().cmp(&b.len())
}

/// The path as errors name fields: `providers[0].base_url`.
fn render_path(path: &[Segment]) -> String {
    let mut out = String::new();
    for segment in path {
        match segment {
            Segment::Key(k) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(k);
            }
            Segment::Index(i) => out.push_str(&format!("[{i}]")),
        }
    }
    out
}

/// One overlay variable.
#[derive(Debug, Clone)]
struct Setting {
    var: String,
    path: Vec<Segment>,
    field: String,
    raw: String,
    value: Value,
}

impl Setting {
    fn parse(var: &str, rest: &str, raw: &str) -> Result<Self, ConfigError> {
        let mut path = Vec::new();
        for segment in rest.split(SEGMENT_SEPARATOR) {
            if segment.is_empty() {
                return Err(env_err(
                    var,
                    "an empty path segment: segments are separated by exactly `__`",
                ));
            }
            if segment.bytes().all(|b| b.is_ascii_digit()) {
                let index = segment
                    .parse::<usize>()
                    .ok()
                    .filter(|i| *i <= MAX_INDEX)
                    .ok_or_else(|| env_err(var, format!("index {segment} is above {MAX_INDEX}")))?;
                if path.is_empty() {
                    return Err(env_err(var, "the path must start with a section name"));
                }
                path.push(Segment::Index(index));
            } else {
                path.push(Segment::Key(segment.to_ascii_lowercase()));
            }
        }
        Ok(Self {
            var: var.to_owned(),
            field: render_path(&path),
            path,
            raw: raw.to_owned(),
            value: typed_value(raw),
        })
    }

    /// A number, boolean or date that may have been meant as text.
    fn may_be_text(&self) -> bool {
        matches!(
            self.value,
            Value::Integer(_) | Value::Float(_) | Value::Boolean(_) | Value::Datetime(_)
        )
    }
}

/// The value as TOML reads it, else the text itself.
fn typed_value(raw: &str) -> Value {
    raw.parse::<Value>()
        .unwrap_or_else(|_| Value::String(raw.to_owned()))
}

fn env_err(var: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Environment {
        var: var.to_owned(),
        message: message.into(),
    }
}

fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::String(_) => "a string",
        Value::Integer(_) => "an integer",
        Value::Float(_) => "a float",
        Value::Boolean(_) => "a boolean",
        Value::Datetime(_) => "a date",
        Value::Array(_) => "an array",
        Value::Table(_) => "a table",
    }
}

/// An empty container for what `next` addresses.
fn container_for(next: &Segment) -> Value {
    match next {
        Segment::Key(_) => Value::Table(toml::Table::new()),
        Segment::Index(_) => Value::Array(Vec::new()),
    }
}

/// Set `setting` in `root`, creating the tables and entries on its way.
fn apply(root: &mut Value, setting: &Setting) -> Result<(), ConfigError> {
    let mut here = root;
    let last = setting.path.len() - 1;
    for (depth, segment) in setting.path.iter().enumerate() {
        let value = if depth == last {
            Some(setting.value.clone())
        } else {
            None
        };
        let next = setting.path.get(depth + 1);
        let so_far = render_path(&setting.path[..depth]);
        here = match (segment, here) {
            (Segment::Key(key), Value::Table(table)) => match value {
                Some(v) => {
                    table.insert(key.clone(), v);
                    return Ok(());
                }
                None => table
                    .entry(key.clone())
                    .or_insert_with(|| container_for(next.unwrap_or(segment))),
            },
            (Segment::Index(index), Value::Array(items)) => {
                if *index > items.len() {
                    return Err(env_err(
                        &setting.var,
                        format!(
                            "`{so_far}` has {} entries: the next is [{}] (entries are \
                             numbered from 0 without gaps)",
                            items.len(),
                            items.len()
                        ),
                    ));
                }
                match value {
                    Some(v) if *index == items.len() => {
                        items.push(v);
                        return Ok(());
                    }
                    Some(v) => {
                        items[*index] = v;
                        return Ok(());
                    }
                    None => {
                        if *index == items.len() {
                            items.push(container_for(next.unwrap_or(segment)));
                        }
                        &mut items[*index]
                    }
                }
            }
            (Segment::Key(_), other) => {
                return Err(env_err(
                    &setting.var,
                    format!("`{so_far}` is {}, not a table", kind_of(other)),
                ));
            }
            (Segment::Index(_), other) => {
                return Err(env_err(
                    &setting.var,
                    format!("`{so_far}` is {}, not an array", kind_of(other)),
                ));
            }
        };
    }
    Ok(())
}

/// Which fields the environment set, for errors that name them.
#[derive(Debug, Clone, Default)]
pub struct EnvSources {
    /// (field path as errors name it, variable).
    fields: Vec<(String, String)>,
}

impl EnvSources {
    /// The variable that set `field`, or a table or array holding it.
    pub fn variable_of(&self, field: &str) -> Option<&str> {
        self.fields
            .iter()
            .filter(|(path, _)| {
                field == path
                    || field
                        .strip_prefix(path.as_str())
                        .is_some_and(|rest| rest.starts_with('.') || rest.starts_with('['))
            })
            .max_by_key(|(path, _)| path.len())
            .map(|(_, var)| var.as_str())
    }

    /// `error`, saying which variable set the field it names.
    pub fn annotate(&self, error: ConfigError) -> ConfigError {
        match error {
            ConfigError::Field { field, message } => match self.variable_of(&field) {
                Some(var) => ConfigError::Field {
                    message: format!("{message} (set by environment variable {var})"),
                    field,
                },
                None => ConfigError::Field { field, message },
            },
            other => other,
        }
    }

    /// How many fields the environment set.
    pub fn len(&self) -> usize {
        self.fields.len()
    }

    /// Whether the environment set no field.
    pub fn is_empty(&self) -> bool {
        self.fields.is_empty()
    }
}

/// The TOML `text` with the variables under `prefix` laid over it,
/// deserialized into `T`. Every error names the field (and the variable
/// when the value came from one).
pub fn deserialize_overlaid<T: DeserializeOwned>(
    text: &str,
    env: &Environment,
    prefix: &str,
) -> Result<(T, EnvSources), ConfigError> {
    let file: toml::Table = toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
    let mut settings = env.settings(prefix)?;
    let sources = EnvSources {
        fields: settings
            .iter()
            .map(|s| (s.field.clone(), s.var.clone()))
            .collect(),
    };
    // Each round either succeeds, fails for good, or turns one more
    // number or boolean into its text: at most one round per variable.
    loop {
        let mut doc = Value::Table(file.clone());
        for setting in &settings {
            apply(&mut doc, setting)?;
        }
        match serde_path_to_error::deserialize::<_, T>(doc) {
            Ok(value) => return Ok((value, sources)),
            Err(e) => {
                let field = e.path().to_string();
                if let Some(setting) = settings
                    .iter_mut()
                    .find(|s| s.field == field && s.may_be_text())
                    && e.inner().message().starts_with("invalid type")
                {
                    setting.value = Value::String(setting.raw.clone());
                    continue;
                }
                return Err(sources.annotate(schema_error(&field, e.inner().message())));
            }
        }
    }
}

/// A deserialization error as a field error: `missing field` and
/// `unknown field` errors name the field itself, not its table.
fn schema_error(path: &str, message: &str) -> ConfigError {
    let named = ["unknown field `", "missing field `"]
        .iter()
        .find_map(|head| message.strip_prefix(head))
        .and_then(|rest| rest.split('`').next());
    let field = match (path, named) {
        ("." | "", Some(name)) => name.to_owned(),
        (".", None) => return ConfigError::Parse(message.to_owned()),
        (path, Some(name)) if !path.ends_with(name) => format!("{path}.{name}"),
        (path, _) => path.to_owned(),
    };
    let message = match message.split_once(", expected") {
        Some((_, expected)) if message.starts_with("unknown field") => {
            format!("unknown field, expected{expected}")
        }
        _ if message.starts_with("missing field") => "required".to_owned(),
        _ => message.to_owned(),
    };
    field_err(field, message)
}

/// A key or secret from exactly one of an environment variable (`var`,
/// from `env`) or a file (its first line), trimmed, and the field it came
/// from. `fields` names the two fields (`("key_env", "key_file")`), `f`
/// makes a field's full path, `base` resolves a relative file. A file
/// readable by others, or by its group unless root owns it, is refused
/// ([`crate::insecure_provided_secret_mode`]). Errors name the field and
/// never show the value.
pub fn read_secret(
    env: &Environment,
    var: Option<&str>,
    file: Option<&Path>,
    base: &Path,
    (env_field, file_field): (&'static str, &'static str),
    f: &dyn Fn(&str) -> String,
) -> Result<(Zeroizing<String>, &'static str), ConfigError> {
    match (var, file) {
        (Some(var), None) => {
            let value = env.var(var).ok_or_else(|| {
                field_err(
                    f(env_field),
                    format!("environment variable `{var}` is not set"),
                )
            })?;
            // Trimmed as a file's line is, and as a presented key is.
            Ok((Zeroizing::new(value.trim().to_owned()), env_field))
        }
        (None, Some(path)) => {
            let path = if path.is_relative() {
                base.join(path)
            } else {
                path.to_path_buf()
            };
            let unreadable = |e: std::io::Error| {
                field_err(
                    f(file_field),
                    format!("cannot read {}: {}", path.display(), e.kind()),
                )
            };
            if let Some(mode) = crate::insecure_provided_secret_mode(&path).map_err(unreadable)? {
                return Err(field_err(
                    f(file_field),
                    format!(
                        "{} has mode {mode:o}: a secret file must not be readable by others, \
                         nor by its group unless root owns it (chmod 600)",
                        path.display()
                    ),
                ));
            }
            let text = Zeroizing::new(std::fs::read_to_string(&path).map_err(unreadable)?);
            let first = text.lines().next().unwrap_or("").trim().to_owned();
            Ok((Zeroizing::new(first), file_field))
        }
        _ => Err(field_err(
            f(env_field),
            format!("exactly one of `{env_field}` or `{file_field}` must be set"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use super::*;

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Doc {
        server: Server,
        #[serde(default)]
        targets: Vec<Target>,
    }

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Server {
        listen: String,
        #[serde(default)]
        max_connections: u32,
        #[serde(default)]
        id: Option<String>,
        #[serde(default)]
        peers: Vec<String>,
        #[serde(default)]
        ratio: f64,
    }

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Target {
        name: String,
        #[serde(default)]
        weight: u32,
    }

    const FILE: &str = "[server]\nlisten = \"127.0.0.1:80\"\n[[targets]]\nname = \"a\"\n";

    fn load(pairs: &[(&str, &str)]) -> Result<Doc, ConfigError> {
        deserialize_overlaid(FILE, &Environment::from_pairs(pairs.iter().copied()), "APP")
            .map(|(doc, _)| doc)
    }

    fn field_and_message(e: ConfigError) -> (String, String) {
        match e {
            ConfigError::Field { field, message } => (field, message),
            other => panic!("expected a field error, got {other}"),
        }
    }

    #[test]
    fn a_variable_sets_a_field_by_its_path_and_typed_value() {
        let doc = load(&[
            ("APP__SERVER__LISTEN", "0.0.0.0:8080"),
            ("APP__SERVER__MAX_CONNECTIONS", "8192"),
            ("APP__SERVER__PEERS", "[\"a:1\", \"b:1\"]"),
            ("APP__SERVER__RATIO", "0.5"),
            ("UNRELATED", "x"),
            ("APP_SERVER__LISTEN", "not our prefix"),
        ])
        .unwrap();
        assert_eq!(doc.server.listen, "0.0.0.0:8080");
        assert_eq!(doc.server.max_connections, 8192);
        assert_eq!(doc.server.peers, ["a:1", "b:1"]);
        assert_eq!(doc.server.ratio, 0.5);
        assert_eq!(doc.targets[0].name, "a", "the file's other values stay");
    }

    #[test]
    fn numeric_segments_index_arrays_of_tables_and_append_without_gaps() {
        let doc = load(&[
            ("APP__TARGETS__0__WEIGHT", "3"),
            ("APP__TARGETS__1__NAME", "b"),
            ("APP__TARGETS__2__NAME", "c"),
            ("APP__TARGETS__2__WEIGHT", "7"),
        ])
        .unwrap();
        let names: Vec<_> = doc.targets.iter().map(|t| (&*t.name, t.weight)).collect();
        assert_eq!(names, [("a", 3), ("b", 0), ("c", 7)]);
        let e = load(&[("APP__TARGETS__3__NAME", "d")]).unwrap_err();
        match e {
            ConfigError::Environment { var, message } => {
                assert_eq!(var, "APP__TARGETS__3__NAME");
                assert!(message.contains("the next is [1]"), "{message}");
            }
            other => panic!("{other}"),
        }
    }

    #[test]
    fn ten_entries_sort_numerically_not_as_text() {
        let pairs: Vec<(String, String)> = (0..11)
            .map(|i| (format!("APP__TARGETS__{i}__NAME"), format!("t{i}")))
            .collect();
        let (doc, sources): (Doc, _) =
            deserialize_overlaid(FILE, &Environment::from_pairs(pairs), "APP").unwrap();
        assert_eq!(doc.targets.len(), 11);
        assert_eq!(doc.targets[10].name, "t10");
        assert_eq!(sources.len(), 11);
    }

    #[test]
    fn a_number_given_to_a_text_field_is_its_text() {
        let doc = load(&[("APP__SERVER__ID", "7"), ("APP__SERVER__LISTEN", "true")]).unwrap();
        assert_eq!(doc.server.id.as_deref(), Some("7"));
        assert_eq!(doc.server.listen, "true");
        let doc = load(&[("APP__SERVER__ID", "\"quoted\"")]).unwrap();
        assert_eq!(doc.server.id.as_deref(), Some("quoted"));
    }

    #[test]
    fn errors_name_the_field_and_the_variable() {
        let (field, message) =
            field_and_message(load(&[("APP__SERVER__MAX_CONNECTIONS", "many")]).unwrap_err());
        assert_eq!(field, "server.max_connections");
        assert!(
            message.contains("APP__SERVER__MAX_CONNECTIONS"),
            "{message}"
        );
        let (field, message) =
            field_and_message(load(&[("APP__SERVER__MAX_CONECTIONS", "8")]).unwrap_err());
        assert_eq!(field, "server.max_conections");
        assert!(message.starts_with("unknown field"), "{message}");
        assert!(message.contains("APP__SERVER__MAX_CONECTIONS"), "{message}");
        let (field, _) = field_and_message(load(&[("APP__SERVERS__LISTEN", "x")]).unwrap_err());
        assert_eq!(field, "servers");
        let (field, message) =
            field_and_message(load(&[("APP__TARGETS__1__WEIGHT", "1")]).unwrap_err());
        assert_eq!(field, "targets[1].name");
        assert!(message.contains("required"), "{message}");
    }

    #[test]
    fn file_errors_name_the_field_without_a_variable() {
        let text = "[server]\nlisten = 1\n";
        let e = deserialize_overlaid::<Doc>(text, &Environment::default(), "APP").unwrap_err();
        let (field, message) = field_and_message(e);
        assert_eq!(field, "server.listen");
        assert!(!message.contains("environment"), "{message}");
        let e = deserialize_overlaid::<Doc>("", &Environment::default(), "APP").unwrap_err();
        assert_eq!(field_and_message(e).0, "server");
        let e = deserialize_overlaid::<Doc>("[server", &Environment::default(), "APP").unwrap_err();
        assert!(matches!(e, ConfigError::Parse(_)), "{e}");
    }

    #[test]
    fn malformed_variables_are_refused_by_name() {
        for (var, says) in [
            ("APP__SERVER____LISTEN", "empty path segment"),
            ("APP__", "empty path segment"),
            ("APP__0__X", "must start with a section"),
            ("APP__SERVER__LISTEN__PORT", "is a string, not a table"),
            ("APP__SERVER__1", "is a table, not an array"),
            ("APP__TARGETS__99999999__NAME", "above"),
        ] {
            match load(&[(var, "1")]).unwrap_err() {
                ConfigError::Environment {
                    var: named,
                    message,
                } => {
                    assert_eq!(named, var);
                    assert!(message.contains(says), "{var}: {message}");
                }
                other => panic!("{var}: {other}"),
            }
        }
    }

    #[test]
    fn a_whole_table_then_a_deeper_variable() {
        let doc = load(&[
            ("APP__SERVER", "{ listen = \"a:1\", max_connections = 2 }"),
            ("APP__SERVER__MAX_CONNECTIONS", "5"),
        ])
        .unwrap();
        assert_eq!(
            (doc.server.listen.as_str(), doc.server.max_connections),
            ("a:1", 5)
        );
    }

    #[test]
    fn the_snapshot_reads_secrets_and_never_shows_values() {
        let env = Environment::from_pairs([("IOP_KEY", "sk-secret-value")]);
        assert_eq!(env.var("IOP_KEY"), Some("sk-secret-value"));
        assert_eq!(env.var("IOP_OTHER"), None);
        assert!(!format!("{env:?}").contains("sk-secret"));
    }
}
