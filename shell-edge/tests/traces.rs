//! Traces across the Edge and the Node: with `[otlp_traces]` on both, a
//! request through Edge and Node becomes one trace at an OTLP/HTTP
//! collector stand-in: the client's `traceparent` (or a new trace) ->
//! `edge.request` -> `node.run` -> `node.provider_call`, the Node's spans
//! joined through the trace context carried in the run request. Spans are
//! also covered by the R-OBS-1 sentinel: no key, prompt, output or run id
//! in anything exported, attribute values closed or configured names.

mod common;

use iop_edge::config::ConfigFile as _;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use common::*;
use iop_edge::server::RunningEdge;
use iop_node::mock::{MockScript, MockServer};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{KeyValue, any_value};
use prost::Message as _;

const KEY: &str = "sk-trace-SENTINEL-0123456789";
const PAYLOAD: &str = "SENTINEL-trace-payload";
const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";
/// The trace of a request whose provider reports prompt-cache counts.
const CACHED_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4737";

/// One exported span, flattened.
#[derive(Debug, Clone)]
struct Exported {
    service: String,
    name: String,
    trace_id: String,
    span_id: String,
    parent_span_id: String,
    attributes: Vec<(String, String)>,
    events: Vec<String>,
    /// 0 unset, 1 ok, 2 error.
    status: i32,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn string_attrs(attrs: &[KeyValue]) -> Vec<(String, String)> {
    attrs
        .iter()
        .map(|kv| {
            let v = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(any_value::Value::StringValue(s)) => s.clone(),
                Some(any_value::Value::BoolValue(b)) => b.to_string(),
                Some(any_value::Value::IntValue(i)) => i.to_string(),
                // A list of closed values (`gen_ai.response.finish_reasons`).
                Some(any_value::Value::ArrayValue(a)) => a
                    .values
                    .iter()
                    .map(|v| match &v.value {
                        Some(any_value::Value::StringValue(s)) => s.clone(),
                        other => format!("{other:?}"),
                    })
                    .collect::<Vec<_>>()
                    .join(","),
                other => format!("{other:?}"),
            };
            (kv.key.clone(), v)
        })
        .collect()
}

/// A loopback OTLP/HTTP traces collector keeping every decoded span.
#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<Exported>>>,
    raw: Arc<Mutex<Vec<u8>>>,
}

impl Collector {
    async fn start(&self) -> SocketAddr {
        let this = self.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |body: axum::body::Bytes| {
                let this = this.clone();
                async move {
                    this.raw.lock().unwrap().extend_from_slice(&body);
                    let Ok(req) = ExportTraceServiceRequest::decode(body) else {
                        return axum::http::StatusCode::BAD_REQUEST;
                    };
                    let mut spans = this.spans.lock().unwrap();
                    for rs in req.resource_spans {
                        let resource =
                            string_attrs(&rs.resource.map(|r| r.attributes).unwrap_or_default());
                        let service = resource
                            .iter()
                            .find(|(k, _)| k == "service.name")
                            .map(|(_, v)| v.clone())
                            .unwrap_or_default();
                        for ss in rs.scope_spans {
                            for s in ss.spans {
                                spans.push(Exported {
                                    service: service.clone(),
                                    name: s.name,
                                    trace_id: hex(&s.trace_id),
                                    span_id: hex(&s.span_id),
                                    parent_span_id: hex(&s.parent_span_id),
                                    attributes: string_attrs(&s.attributes),
                                    events: s.events.into_iter().map(|e| e.name).collect(),
                                    status: s.status.map_or(0, |st| st.code),
                                });
                            }
                        }
                    }
                    axum::http::StatusCode::OK
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        addr
    }

    fn spans(&self) -> Vec<Exported> {
        self.spans.lock().unwrap().clone()
    }

    fn find(&self, trace_id: &str, name: &str) -> Vec<Exported> {
        self.spans()
            .into_iter()
            .filter(|s| s.trace_id == trace_id && s.name == name)
            .collect()
    }

    async fn wait(&self, what: &str, check: impl Fn(&Self) -> bool) {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(15);
        while !check(self) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}; spans: {:#?}",
                self.spans()
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
}

fn attr<'a>(span: &'a Exported, key: &str) -> Option<&'a str> {
    span.attributes
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

/// The one span called `name` in `trace_id`, exported by `service`.
fn one(collector: &Collector, trace_id: &str, name: &str, service: &str) -> Exported {
    let spans = collector.find(trace_id, name);
    assert_eq!(spans.len(), 1, "one {name} in trace {trace_id}: {spans:#?}");
    assert_eq!(spans[0].service, service, "{name} comes from {service}");
    spans[0].clone()
}

#[tokio::test]
async fn one_trace_joins_edge_and_node_spans_without_payload() {
    bounded(async {
        let collector = Collector::default();
        let addr = collector.start().await;
        let traces = format!("[otlp_traces]\nendpoint = \"http://{addr}\"\ninterval_ms = 100\n");
        let pki = Pki::new(&["node-1"]);
        common::write_secret(&pki.path().join("key"), KEY);
        let mock = MockServer::start(MockScript::default()).await.unwrap();
        let edge = RunningEdge::start(edge_config(
            &pki,
            0,
            &format!(
                "[[providers]]\nid = \"p1\"\nnode = \"node-1\"\nadapter = \"openai\"\ntarget = \"t\"\nstall_timeout_ms = 300\n\
                 [[routes]]\nmodel = \"mock*\"\nproviders = [\"p1\"]\n\
                 [[api_keys]]\nprincipal = \"traces\"\nkey_file = \"key\"\n{traces}"
            ),
        ))
        .await
        .unwrap();
        let node = start_node(
            &pki,
            "node-1",
            edge.quic_addr,
            &format!(
                "[[providers]]\nadapter = \"openai\"\ntarget = \"t\"\nbase_url = \"{}\"\n{traces}",
                mock.base_url()
            ),
        );
        ready_generation(&edge, "node-1").await;
        let http = reqwest::Client::new();
        let url = format!("http://{}/v1/chat/completions", edge.http_addr);
        let send = |model: &'static str, stream: bool, traceparent: Option<String>| {
            let http = http.clone();
            let url = url.clone();
            async move {
                let body = format!(
                    r#"{{"model":"{model}","stream":{stream},"messages":[{{"role":"user","content":"{PAYLOAD}"}}]}}"#
                );
                let mut req = http
                    .post(&url)
                    .bearer_auth(KEY)
                    .header("content-type", "application/json")
                    .body(body);
                if let Some(tp) = traceparent {
                    req = req.header("traceparent", tp);
                }
                let r = req.send().await.unwrap();
                let status = r.status();
                let _ = r.text().await;
                status
            }
        };

        // 1. The client's trace context is joined.
        let status = send(
            "mock",
            true,
            Some(format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")),
        )
        .await;
        assert!(status.is_success(), "{status}");
        collector
            .wait("the client's trace with its Node spans", |c| {
                !c.find(CLIENT_TRACE, "edge.request").is_empty()
                    && !c.find(CLIENT_TRACE, "edge.queue_wait").is_empty()
                    && !c.find(CLIENT_TRACE, "edge.attempt").is_empty()
                    && !c.find(CLIENT_TRACE, "node.run").is_empty()
                    && !c.find(CLIENT_TRACE, "node.provider_call").is_empty()
            })
            .await;
        let request = one(&collector, CLIENT_TRACE, "edge.request", "iop-edge");
        let wait = one(&collector, CLIENT_TRACE, "edge.queue_wait", "iop-edge");
        let attempt = one(&collector, CLIENT_TRACE, "edge.attempt", "iop-edge");
        let run = one(&collector, CLIENT_TRACE, "node.run", "iop-node");
        let call = one(&collector, CLIENT_TRACE, "node.provider_call", "iop-node");
        assert_eq!(request.parent_span_id, CLIENT_SPAN, "edge.request is the client's child");
        assert_eq!(wait.parent_span_id, request.span_id, "edge.queue_wait is edge.request's child");
        assert_eq!(attempt.parent_span_id, request.span_id, "edge.attempt is edge.request's child");
        assert_eq!(run.parent_span_id, attempt.span_id, "node.run is edge.attempt's child");
        assert_eq!(call.parent_span_id, run.span_id, "node.provider_call is node.run's child");
        assert_eq!(attr(&request, "iop.route"), Some("chat"));
        // The GenAI conventions on the request span: the operation, the
        // provider's API flavour and the Node that reached it, the route's
        // model (its configured pattern, never the client's string), the
        // answer's usage and finish reason.
        for (key, value) in [
            ("gen_ai.operation.name", "chat"),
            ("gen_ai.provider.name", "openai"),
            ("gen_ai.request.model", "mock*"),
            ("gen_ai.response.model", "mock*"),
            ("gen_ai.response.finish_reasons", "stop"),
            ("server.address", "node-1"),
        ] {
            assert_eq!(attr(&request, key), Some(value), "{key} on edge.request");
        }
        let tokens = |key| attr(&request, key).and_then(|v| v.parse::<u64>().ok());
        assert!(tokens("gen_ai.usage.input_tokens") > Some(0), "{request:?}");
        assert!(tokens("gen_ai.usage.output_tokens") > Some(0), "{request:?}");
        // A provider that reports no prompt cache: no cache counts, never
        // zeros.
        for key in [
            "gen_ai.usage.cache_read.input_tokens",
            "gen_ai.usage.cache_creation.input_tokens",
        ] {
            assert_eq!(attr(&request, key), None, "{key}");
        }
        assert_eq!(attr(&request, "iop.outcome"), Some("ok"));
        assert!(request.events.iter().any(|e| e == "committed"));
        assert_eq!(request.status, 1);
        assert_eq!(attr(&run, "iop.kind"), Some("normalized"));
        assert_eq!(attr(&run, "iop.target"), Some("t"));
        assert_eq!(attr(&run, "iop.outcome"), Some("ok"));
        assert_eq!(attr(&call, "iop.adapter"), Some("openai"));
        assert!(attr(&call, "iop.ttft_ms").is_some(), "the provider call carries its TTFT");
        assert!(call.events.iter().any(|e| e == "first_content"));

        // The prompt cache's counts as the provider reported them: 2 of
        // the prompt's tokens read from its cache, 1 written to it.
        let status = send(
            "mock:cache_read=2,cache_write=1",
            false,
            Some(format!("00-{CACHED_TRACE}-{CLIENT_SPAN}-01")),
        )
        .await;
        assert!(status.is_success(), "{status}");
        collector
            .wait("the cached request's span", |c| {
                !c.find(CACHED_TRACE, "edge.request").is_empty()
            })
            .await;
        let cached = one(&collector, CACHED_TRACE, "edge.request", "iop-edge");
        let tokens = |key| attr(&cached, key).and_then(|v| v.parse::<u64>().ok());
        assert_eq!(tokens("gen_ai.usage.cache_read.input_tokens"), Some(2), "{cached:?}");
        assert_eq!(tokens("gen_ai.usage.cache_creation.input_tokens"), Some(1));
        assert!(tokens("gen_ai.usage.input_tokens") >= Some(3), "cached tokens are input tokens");

        // 2. Without a traceparent the Edge starts a new trace, still
        // joined by the Node; a malformed one is ignored the same way.
        let before: std::collections::BTreeSet<String> =
            collector.spans().into_iter().map(|s| s.trace_id).collect();
        assert!(send("mock", false, None).await.is_success());
        assert!(send("mock", false, Some("00-garbage-01".into())).await.is_success());
        collector
            .wait("two new traces, each with a node.run", |c| {
                let fresh: Vec<Exported> = c
                    .spans()
                    .into_iter()
                    .filter(|s| !before.contains(&s.trace_id))
                    .collect();
                let requests: Vec<&Exported> =
                    fresh.iter().filter(|s| s.name == "edge.request").collect();
                requests.len() == 2
                    && requests.iter().all(|r| {
                        r.parent_span_id.is_empty()
                            && fresh.iter().any(|a| {
                                a.name == "edge.attempt"
                                    && a.parent_span_id == r.span_id
                                    && fresh.iter().any(|s| {
                                        s.name == "node.run" && s.parent_span_id == a.span_id
                                    })
                            })
                    })
            })
            .await;

        // 3. Failures: a stall and a provider error end spans with a closed
        // error class.
        send("mock:stall_after=1", true, None).await;
        send("mock:error=500", false, None).await;
        collector
            .wait("failed node.run spans", |c| {
                c.spans()
                    .iter()
                    .filter(|s| s.name == "node.run" && s.status == 2)
                    .count()
                    >= 2
            })
            .await;
        wait_for(&edge, "idle", |s| s.leases_in_use == 0).await;
        node.shutdown().await.unwrap();
        edge.shutdown().await;

        // R-OBS-1 over spans: nothing from a client or a provider.
        let raw = collector.raw.lock().unwrap().clone();
        let raw = String::from_utf8_lossy(&raw);
        for marker in [KEY, PAYLOAD, "SENTINEL", "run_id", "mock:"] {
            assert!(!raw.contains(marker), "{marker} leaked into the exported spans");
        }
        for s in collector.spans() {
            assert!(
                ["edge.request", "edge.queue_wait", "edge.attempt", "node.run", "node.provider_call", "node.probe", "node.dial"]
                    .contains(&s.name.as_str()),
                "unexpected span {}",
                s.name
            );
            for (k, v) in &s.attributes {
                if k == "gen_ai.request.model" || k == "gen_ai.response.model" {
                    assert_eq!(v, "mock*", "{}: the configured route, not the client's model", s.name);
                    continue;
                }
                assert!(
                    v.len() <= 64
                        && v.chars().all(|c| c.is_ascii_lowercase()
                            || c.is_ascii_digit()
                            || matches!(c, '_' | '.' | '-')),
                    "{}: attribute {k}={v} is not a closed value or configured name",
                    s.name
                );
            }
        }
    })
    .await;
}

#[test]
fn otlp_traces_config_errors_name_the_field_on_both_binaries() {
    let pki = Pki::new(&["node-1"]);
    let edge = |section: &str| {
        let text = format!(
            "[edge]\nquic_listen = \"127.0.0.1:0\"\nhttp_listen = \"127.0.0.1:0\"\nstate_dir = \"s\"\n\
             [tls]\nca = \"certs/ca.pem\"\ncert = \"certs/edge.pem\"\nkey = \"certs/edge.key\"\n{section}"
        );
        iop_edge::config::EdgeConfig::parse(&text, pki.path())
    };
    let node = |section: &str| {
        let text = format!(
            "[node]\nedge = \"127.0.0.1:1\"\nstate_dir = \"n\"\n\
             [tls]\nca = \"certs/ca.pem\"\ncert = \"certs/node-node-1.pem\"\nkey = \"certs/node-node-1.key\"\n{section}"
        );
        iop_node::config::NodeConfig::parse(&text, pki.path())
    };
    let ok = edge("[otlp_traces]\nendpoint = \"http://collector:4318\"\n").unwrap();
    let traces = ok.otlp_traces.unwrap();
    assert_eq!(traces.endpoint, "http://collector:4318/v1/traces");
    assert_eq!((traces.sample_ratio, traces.max_queue_spans), (1.0, 2048));
    assert!(
        edge("").unwrap().otlp_traces.is_none(),
        "span export is off unless configured"
    );
    assert!(
        node("[otlp_traces]\nendpoint = \"https://c/v1/traces\"\n")
            .unwrap()
            .otlp_traces
            .is_some()
    );
    for (section, field) in [
        (
            "[otlp_traces]\nendpoint = \"collector:4318\"\n",
            "otlp_traces.endpoint",
        ),
        (
            "[otlp_traces]\nendpoint = \"http://c\"\nsample_ratio = 2.0\n",
            "otlp_traces.sample_ratio",
        ),
        (
            "[otlp_traces]\nendpoint = \"http://c\"\nmax_queue_spans = 0\n",
            "otlp_traces.max_queue_spans",
        ),
    ] {
        let e = edge(section).unwrap_err().to_string();
        assert!(e.contains(field), "edge: {e}");
        let e = node(section).unwrap_err().to_string();
        assert!(e.contains(field), "node: {e}");
    }
    let e = edge("[otlp_traces]\nendpoint = \"http://c\"\ntypo = 1\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("typo"),
        "unknown fields are refused by name: {e}"
    );
}
