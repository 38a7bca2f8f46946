//! The commented example configuration: what `iop-node config example`
//! prints and the Debian package installs as `/etc/iop/node.toml`. Its
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
    use crate::config::NodeConfig;

    fn load(text: &str) -> NodeConfig {
        let env = Environment::from_pairs([("IOP_PROVIDER_KEY", "sk-provider")]);
        NodeConfig::parse_in(text, Path::new("/etc/iop"), &env)
            .unwrap_or_else(|e| panic!("{e}\n{text}"))
    }

    #[test]
    fn the_example_loads_as_it_is() {
        let c = load(EXAMPLE);
        assert_eq!(c.edges, ["localhost:7443"]);
        assert_eq!(c.node.state_dir, Path::new("/var/lib/iop-node"));
        assert_eq!(
            c.providers[0].base_url.as_deref(),
            Some("http://127.0.0.1:8000")
        );
        assert!(c.providers[0].api_key.is_none());
        assert!(c.node.metrics_listen.is_none());
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
        assert!(c.node.metrics_listen.is_some());
        assert_eq!(c.providers[0].api_key.as_deref(), Some("sk-provider"));
        assert_eq!(c.providers[0].max_concurrent_runs, Some(32));
        assert!(c.otlp.is_some() && c.otlp_traces.is_some());
    }
}
