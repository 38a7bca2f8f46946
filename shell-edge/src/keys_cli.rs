//! `iop-edge keys ...`: runtime API keys and usage (R-TEN-4, R-TEN-5)
//! over the admin API of a running Edge ([`crate::admin`]), with an admin
//! key read from an environment variable (never from the command line,
//! where other users of the machine could read it).

use anyhow::Context;
use serde_json::{Map, Value, json};

/// What `keys` does.
#[derive(Debug, clap::Subcommand)]
pub enum KeysCommand {
    /// Create a key; prints it with its secret (shown this once).
    Create {
        /// The principal the key belongs to.
        #[arg(long)]
        principal: String,
        #[command(flatten)]
        fields: KeyOptions,
    },
    /// List the keys (the config file's and the runtime keys).
    List {
        /// Print the raw JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show one key.
    Get {
        /// The key's id.
        id: String,
    },
    /// Change a key's name, models, limits or expiry (limits given replace
    /// the key's limits).
    Update {
        /// The key's id.
        id: String,
        #[command(flatten)]
        fields: KeyOptions,
        /// Remove the key's expiry.
        #[arg(long, conflicts_with = "expires_at")]
        no_expiry: bool,
    },
    /// Revoke a key: refused on every Edge within `key_sync_ms`.
    Revoke {
        /// The key's id.
        id: String,
    },
    /// Give a key a new secret (printed this once); the old one stops.
    Rotate {
        /// The key's id.
        id: String,
    },
    /// Usage and spend per day, principal, key and model.
    Usage {
        /// First day, YYYY-MM-DD (default: 30 days before `--to`).
        #[arg(long)]
        from: Option<String>,
        /// Last day, YYYY-MM-DD (default: today, UTC).
        #[arg(long)]
        to: Option<String>,
        /// Only this principal.
        #[arg(long)]
        principal: Option<String>,
        /// Only this key id.
        #[arg(long)]
        key: Option<String>,
    },
}

/// The fields of a key a command may set.
#[derive(Debug, Default, clap::Args)]
pub struct KeyOptions {
    /// A name for people.
    #[arg(long)]
    name: Option<String>,
    /// A model the key may use (repeat; a trailing `*` matches a prefix;
    /// default on create: `*`).
    #[arg(long = "model")]
    models: Vec<String>,
    /// Requests per minute.
    #[arg(long)]
    requests_per_minute: Option<u64>,
    /// Input + output tokens per minute.
    #[arg(long)]
    tokens_per_minute: Option<u64>,
    /// Requests in flight at once.
    #[arg(long)]
    concurrent_requests: Option<u64>,
    /// Spend per budget period, in micro-units of the price table.
    #[arg(long)]
    budget_micros: Option<u64>,
    /// `day`, `month` or `total`.
    #[arg(long)]
    budget_period: Option<String>,
    /// Bytes its durable responses may hold in the journal.
    #[arg(long)]
    journal_bytes: Option<u64>,
    /// Background responses not yet ended.
    #[arg(long)]
    background_responses: Option<u64>,
    /// Requests per minute of one model, `MODEL=N` (repeat for more
    /// models; at most 16 models in all).
    #[arg(long = "model-requests-per-minute", value_name = "MODEL=N")]
    model_requests_per_minute: Vec<String>,
    /// Input + output tokens per minute of one model, `MODEL=N` (repeat).
    #[arg(long = "model-tokens-per-minute", value_name = "MODEL=N")]
    model_tokens_per_minute: Vec<String>,
    /// Requests of one model in flight at once, `MODEL=N` (repeat).
    #[arg(long = "model-concurrent-requests", value_name = "MODEL=N")]
    model_concurrent_requests: Vec<String>,
    /// When it stops working, Unix seconds.
    #[arg(long)]
    expires_at: Option<u64>,
}

/// `MODEL=N` of a per-model flag: the model and the number.
fn model_and_number(flag: &str, value: &str) -> anyhow::Result<(String, u64)> {
    let (model, n) = value
        .rsplit_once('=')
        .filter(|(model, _)| !model.is_empty())
        .with_context(|| format!("--{flag} takes MODEL=N, not {value:?}"))?;
    let n = n
        .parse()
        .with_context(|| format!("--{flag} {value:?}: N must be a whole number"))?;
    Ok((model.to_owned(), n))
}

impl KeyOptions {
    fn body(&self, body: &mut Map<String, Value>) -> anyhow::Result<()> {
        if let Some(name) = &self.name {
            body.insert("name".into(), json!(name));
        }
        if !self.models.is_empty() {
            body.insert("models".into(), json!(self.models));
        }
        let mut limits = Map::new();
        for (name, value) in [
            ("requests_per_minute", self.requests_per_minute),
            ("tokens_per_minute", self.tokens_per_minute),
            ("concurrent_requests", self.concurrent_requests),
            ("budget_micros", self.budget_micros),
            ("journal_bytes", self.journal_bytes),
            ("background_responses", self.background_responses),
        ] {
            if let Some(v) = value {
                limits.insert(name.into(), json!(v));
            }
        }
        if let Some(period) = &self.budget_period {
            limits.insert("budget_period".into(), json!(period));
        }
        let mut per_model = Map::new();
        for (flag, name, values) in [
            (
                "model-requests-per-minute",
                "requests_per_minute",
                &self.model_requests_per_minute,
            ),
            (
                "model-tokens-per-minute",
                "tokens_per_minute",
                &self.model_tokens_per_minute,
            ),
            (
                "model-concurrent-requests",
                "concurrent_requests",
                &self.model_concurrent_requests,
            ),
        ] {
            for value in values {
                let (model, n) = model_and_number(flag, value)?;
                let entry = per_model
                    .entry(model)
                    .or_insert_with(|| Value::Object(Map::new()));
                if let Value::Object(entry) = entry {
                    entry.insert(name.into(), json!(n));
                }
            }
        }
        if !per_model.is_empty() {
            limits.insert("per_model".into(), Value::Object(per_model));
        }
        if !limits.is_empty() {
            body.insert("limits".into(), Value::Object(limits));
        }
        if let Some(at) = self.expires_at {
            body.insert("expires_at".into(), json!(at));
        }
        Ok(())
    }
}

/// Run `command` against the Edge at `url` with the admin key `key`;
/// what to print.
pub async fn run(url: &str, key: &str, command: &KeysCommand) -> anyhow::Result<String> {
    let base = url.trim_end_matches('/');
    let client = reqwest::Client::new();
    let (method, path, body) = match command {
        KeysCommand::Create { principal, fields } => {
            let mut body = Map::new();
            body.insert("principal".into(), json!(principal));
            fields.body(&mut body)?;
            (reqwest::Method::POST, "/admin/keys".to_owned(), Some(body))
        }
        KeysCommand::List { .. } => (reqwest::Method::GET, "/admin/keys".to_owned(), None),
        KeysCommand::Get { id } => (reqwest::Method::GET, format!("/admin/keys/{id}"), None),
        KeysCommand::Update {
            id,
            fields,
            no_expiry,
        } => {
            let mut body = Map::new();
            fields.body(&mut body)?;
            if *no_expiry {
                body.insert("expires_at".into(), Value::Null);
            }
            anyhow::ensure!(
                !body.is_empty(),
                "nothing to change: give at least one option"
            );
            (
                reqwest::Method::PATCH,
                format!("/admin/keys/{id}"),
                Some(body),
            )
        }
        KeysCommand::Revoke { id } => (
            reqwest::Method::POST,
            format!("/admin/keys/{id}/revoke"),
            None,
        ),
        KeysCommand::Rotate { id } => (
            reqwest::Method::POST,
            format!("/admin/keys/{id}/rotate"),
            None,
        ),
        KeysCommand::Usage {
            from,
            to,
            principal,
            key,
        } => {
            let query: Vec<(&str, &String)> = [
                ("from", from.as_ref()),
                ("to", to.as_ref()),
                ("principal", principal.as_ref()),
                ("key", key.as_ref()),
            ]
            .into_iter()
            .filter_map(|(n, v)| Some((n, v?)))
            .collect();
            let query = serde_urlencoded::to_string(&query).context("encoding the query")?;
            let path = if query.is_empty() {
                "/admin/usage".to_owned()
            } else {
                format!("/admin/usage?{query}")
            };
            (reqwest::Method::GET, path, None)
        }
    };
    let mut request = client
        .request(method, format!("{base}{path}"))
        .bearer_auth(key);
    if let Some(body) = body {
        request = request
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(serde_json::to_vec(&Value::Object(body))?);
    }
    let response = request
        .send()
        .await
        .with_context(|| format!("calling {base}{path}"))?;
    let status = response.status();
    let bytes = response.bytes().await?;
    let doc: Value = serde_json::from_slice(&bytes)
        .with_context(|| format!("{base}{path} answered {status} without JSON"))?;
    if !status.is_success() {
        anyhow::bail!(
            "{status}: {}",
            doc["error"]["message"].as_str().unwrap_or("(no message)")
        );
    }
    Ok(match command {
        KeysCommand::List { json: false } => key_table(&doc),
        _ => format!("{}\n", serde_json::to_string_pretty(&doc)?),
    })
}

/// The key list as a table.
pub fn key_table(doc: &Value) -> String {
    let mut out = format!(
        "{:<22} {:<8} {:<20} {:<8} {}\n",
        "ID", "SOURCE", "PRINCIPAL", "STATUS", "MODELS"
    );
    for k in doc["data"].as_array().into_iter().flatten() {
        let models: Vec<&str> = k["models"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        out.push_str(&format!(
            "{:<22} {:<8} {:<20} {:<8} {}\n",
            k["id"].as_str().unwrap_or("?"),
            k["source"].as_str().unwrap_or("?"),
            k["principal"].as_str().unwrap_or("?"),
            k["status"].as_str().unwrap_or("?"),
            models.join(",")
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, clap::Parser)]
    struct Cli {
        #[command(subcommand)]
        keys: KeysCommand,
    }

    fn body_of(args: &[&str]) -> anyhow::Result<Value> {
        let cli = Cli::try_parse_from(std::iter::once("keys").chain(args.iter().copied()))?;
        let KeysCommand::Create { fields, .. } = cli.keys else {
            anyhow::bail!("not create");
        };
        let mut body = Map::new();
        fields.body(&mut body)?;
        Ok(Value::Object(body))
    }

    #[test]
    fn r_ten_1_per_model_flags_become_the_limits_per_model() {
        let body = body_of(&[
            "create",
            "--principal",
            "team-a",
            "--requests-per-minute",
            "60",
            "--model-requests-per-minute",
            "gpt-4o=10",
            "--model-tokens-per-minute",
            "gpt-4o=2000",
            "--model-concurrent-requests",
            "llama3:8b=2",
        ])
        .unwrap();
        assert_eq!(
            body["limits"],
            json!({
                "requests_per_minute": 60,
                "per_model": {
                    "gpt-4o": { "requests_per_minute": 10, "tokens_per_minute": 2000 },
                    "llama3:8b": { "concurrent_requests": 2 },
                },
            })
        );
        for bad in ["gpt-4o", "=3", "gpt-4o=x"] {
            let err = body_of(&[
                "create",
                "--principal",
                "p",
                "--model-requests-per-minute",
                bad,
            ])
            .unwrap_err();
            assert!(
                err.to_string().contains("--model-requests-per-minute"),
                "{err}"
            );
        }
    }
}
