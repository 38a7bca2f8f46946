//! `iop-node mock-provider`: the HTTP mock as a standalone process.

use std::net::SocketAddr;

use anyhow::Context;

use super::{MockApis, MockScript, ProbeHealth, ServeOptions, serve_with};

/// Flags of `iop-node mock-provider`. Every flag sets a default of the
/// script; a request's model name may still override it (see [`crate::mock`]).
#[derive(Clone, clap::Args)]
pub struct MockArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:11435")]
    pub listen: SocketAddr,
    /// Tokens per second; 0 = as fast as possible.
    #[arg(long, default_value_t = 0.0)]
    pub tps: f64,
    /// Delay before the first token, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub prefill_ms: u64,
    /// Text tokens per answer.
    #[arg(long, default_value_t = 8)]
    pub tokens: u32,
    /// Stop producing after N tokens and hang until the client disconnects.
    #[arg(long)]
    pub stall_after: Option<u32>,
    /// Never send response headers (hang until the client disconnects).
    #[arg(long)]
    pub hang_before_headers: bool,
    /// Answer every provider call with this HTTP status (400-599).
    #[arg(long, value_parser = clap::value_parser!(u16).range(400..=599))]
    pub http_error: Option<u16>,
    /// Emit one unparseable chunk after N tokens.
    #[arg(long)]
    pub malformed_after: Option<u32>,
    /// Close the connection without a terminal after N tokens.
    #[arg(long)]
    pub close_after: Option<u32>,
    /// Answer chat calls with one tool call instead of text.
    #[arg(long)]
    pub tool_call: bool,
    /// Streams carry no usage even when asked (as llama-cpp-python's).
    #[arg(long)]
    pub no_stream_usage: bool,
    /// Require `Authorization: Bearer <KEY>` on every call (401 otherwise).
    #[arg(long, env = "IOP_MOCK_REQUIRE_KEY", hide_env_values = true)]
    pub require_key: Option<String>,
    /// What `GET /v1/models` and `GET /api/tags` answer.
    #[arg(long, value_enum, default_value_t = ProbeHealth::Ok)]
    pub health: ProbeHealth,
    /// Leave Nagle's algorithm on for accepted connections (no
    /// `TCP_NODELAY`), as many real servers do: a small write then waits
    /// for the client's delayed ACK of the previous one.
    #[arg(long)]
    pub nagle: bool,
    /// Serve only Anthropic's Messages API (`POST /v1/messages`, `GET
    /// /v1/models`, the key in `x-api-key`), as Anthropic's own server.
    #[arg(long)]
    pub messages_only: bool,
}

impl std::fmt::Debug for MockArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MockArgs")
            .field("listen", &self.listen)
            .field("script", &self.script())
            .field("nagle", &self.nagle)
            .field("messages_only", &self.messages_only)
            .finish()
    }
}

impl MockArgs {
    /// How the server treats accepted connections.
    pub fn serve_options(&self) -> ServeOptions {
        ServeOptions {
            nodelay: !self.nagle,
            apis: if self.messages_only {
                MockApis::MessagesOnly
            } else {
                MockApis::All
            },
        }
    }

    /// The default script these flags describe.
    pub fn script(&self) -> MockScript {
        MockScript {
            tokens_per_second: self.tps,
            prefill_ms: self.prefill_ms,
            tokens: self.tokens,
            stall_after: self.stall_after,
            resume_after_ms: None,
            hang_before_headers: self.hang_before_headers,
            http_error: self.http_error,
            malformed_after: self.malformed_after,
            abrupt_close_after: self.close_after,
            tool_call: self.tool_call,
            stream_usage: !self.no_stream_usage,
            // Per request, through the model name (`mock:cache_read=N`).
            cache_read_tokens: None,
            cache_write_tokens: None,
            health: self.health,
            require_key: self.require_key.clone(),
        }
    }
}

/// Serve the mock until Ctrl-C, printing the listen address first.
pub async fn run_cli(args: MockArgs) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let server = serve_with(listener, args.script(), args.serve_options())
        .await
        .context("starting the mock provider")?;
    println!("iop mock provider listening on http://{}", server.addr());
    tokio::signal::ctrl_c()
        .await
        .context("waiting for Ctrl-C")?;
    drop(server);
    Ok(())
}
