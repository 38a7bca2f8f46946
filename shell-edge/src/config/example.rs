//! The commented example configuration: what `iop-edge config example`
//! prints and the Debian package installs as `/etc/iop/edge.toml`. Its
//! tests load it with the real loader three ways (as it is, with its
//! commented defaults turned on, with every optional setting turned on),
//! so it cannot drift from the code.

/// The example, `example.toml` beside this file.
pub const EXAMPLE: &str = include_str!("example.toml");

#[cfg(test)]
mod tests {
    use iop_transport::config_file::ConfigFile as _;
    use std::path::Path;

    use iop_transport::environment::Environment;
    use iop_transport::settings::{ExampleLines, uncomment_example};

    use super::EXAMPLE;
    use crate::config::{EdgeConfig, JournalStoreKind};

    fn env() -> Environment {
        Environment::from_pairs([
            ("IOP_ADMIN_KEY", "sk-example-admin-key-0123456789"),
            ("IOP_NATS_PASSWORD", "nats-password"),
            ("IOP_OPENAI_KEY", "sk-example-provider-key"),
        ])
    }

    fn load(text: &str) -> EdgeConfig {
        EdgeConfig::parse_in(text, Path::new("/etc/iop"), &env())
            .unwrap_or_else(|e| panic!("{e}\n{text}"))
    }

    #[test]
    fn the_example_loads_as_it_is() {
        let c = load(EXAMPLE);
        assert_eq!(c.edge.state_dir, Path::new("/var/lib/iop-edge"));
        assert_eq!(c.tls.key, Path::new("/etc/iop/edge.key"));
        assert_eq!(c.providers[0].spec.id.as_str(), "node-1-local");
        assert!(c.api_keys[0].admin);
        assert_eq!(c.journal.store, JournalStoreKind::Embedded);
        assert!(c.otlp.is_none());
    }

    #[test]
    fn the_examples_commented_defaults_are_the_defaults() {
        let defaults = uncomment_example(EXAMPLE, ExampleLines::Defaults).unwrap();
        assert_ne!(defaults, EXAMPLE, "the example shows defaults");
        assert_eq!(
            format!("{:?}", load(&defaults)),
            format!("{:?}", load(EXAMPLE)),
            "a `# name = value` line of the example is not the default"
        );
    }

    #[test]
    fn every_optional_setting_of_the_example_loads() {
        let all = uncomment_example(EXAMPLE, ExampleLines::All).unwrap();
        let c = load(&all);
        assert_eq!(c.edge.edge_id(), "edge-1");
        assert_eq!(c.journal.store, JournalStoreKind::Nats);
        assert_eq!(c.journal.nats.as_ref().map(|n| n.replicas), Some(3));
        assert_eq!(c.credentials[0].profile, "openai-prod");
        assert_eq!(c.principals.len(), 1);
        assert!(c.otlp.is_some() && c.otlp_traces.is_some());
        assert!(c.route("llama-3.1-8b").is_some());
    }
}
