//! Optional OTLP metrics export (R-OBS-1): with `[otlp]` configured, the
//! Edge and the Node push the same instruments `/metrics` shows to an
//! OTLP/HTTP collector, with closed label values only, and flush the final
//! counts at graceful shutdown.

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use common::*;
use iop_edge::server::RunningEdge;
use iop_node::mock::{MockScript, MockServer};
use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::common::v1::{KeyValue, any_value};
use opentelemetry_proto::tonic::metrics::v1::{metric, number_data_point};
use prost::Message as _;

const KEY: &str = "sk-otlp-SENTINEL-0123456789";
const PAYLOAD: &str = "SENTINEL-otlp-payload";

/// One exported data point, flattened.
#[derive(Debug, Clone)]
struct Point {
    service: String,
    instance: String,
    metric: String,
    attributes: Vec<(String, String)>,
    /// Sum or gauge value; a histogram's count.
    value: f64,
}

/// A loopback OTLP/HTTP collector keeping every decoded point.
#[derive(Clone, Default)]
struct Collector {
    exports: Arc<Mutex<Vec<Vec<Point>>>>,
    raw: Arc<Mutex<Vec<u8>>>,
}

fn string_attrs(attrs: &[KeyValue]) -> Vec<(String, String)> {
    attrs
        .iter()
        .map(|kv| {
            let v = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(any_value::Value::StringValue(s)) => s.clone(),
                Some(any_value::Value::BoolValue(b)) => b.to_string(),
                Some(any_value::Value::IntValue(i)) => i.to_string(),
                other => format!("{other:?}"),
            };
            (kv.key.clone(), v)
        })
        .collect()
}

fn number(v: &Option<number_data_point::Value>) -> f64 {
    match v {
        Some(number_data_point::Value::AsInt(i)) => *i as f64,
        Some(number_data_point::Value::AsDouble(d)) => *d,
        None => 0.0,
    }
}

fn flatten(req: ExportMetricsServiceRequest) -> Vec<Point> {
    let mut out = Vec::new();
    for rm in req.resource_metrics {
        let resource = string_attrs(&rm.resource.map(|r| r.attributes).unwrap_or_default());
        let find = |k: &str| {
            resource
                .iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.clone())
                .unwrap_or_default()
        };
        let (service, instance) = (find("service.name"), find("service.instance.id"));
        for sm in rm.scope_metrics {
            for m in sm.metrics {
                let mut push = |attributes: &[KeyValue], value: f64| {
                    out.push(Point {
                        service: service.clone(),
                        instance: instance.clone(),
                        metric: m.name.clone(),
                        attributes: string_attrs(attributes),
                        value,
                    })
                };
                match &m.data {
                    Some(metric::Data::Sum(s)) => {
                        for p in &s.data_points {
                            push(&p.attributes, number(&p.value));
                        }
                    }
                    Some(metric::Data::Gauge(g)) => {
                        for p in &g.data_points {
                            push(&p.attributes, number(&p.value));
                        }
                    }
                    Some(metric::Data::Histogram(h)) => {
                        for p in &h.data_points {
                            push(&p.attributes, p.count as f64);
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    out
}

impl Collector {
    async fn start(&self) -> SocketAddr {
        let this = self.clone();
        let app = axum::Router::new().route(
            "/v1/metrics",
            axum::routing::post(move |body: axum::body::Bytes| {
                let this = this.clone();
                async move {
                    this.raw.lock().unwrap().extend_from_slice(&body);
                    match ExportMetricsServiceRequest::decode(body) {
                        Ok(req) => {
                            this.exports.lock().unwrap().push(flatten(req));
                            (axum::http::StatusCode::OK, Vec::new())
                        }
                        Err(_) => (axum::http::StatusCode::BAD_REQUEST, Vec::new()),
                    }
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

    fn points(&self) -> Vec<Point> {
        self.exports
            .lock()
            .unwrap()
            .iter()
            .flatten()
            .cloned()
            .collect()
    }

    /// The value of `metric` in the latest export of `service` that has it,
    /// summed over points whose attributes contain every pair of `attrs`.
    fn latest(&self, service: &str, metric: &str, attrs: &[(&str, &str)]) -> Option<f64> {
        let exports = self.exports.lock().unwrap();
        exports.iter().rev().find_map(|export| {
            let points: Vec<&Point> = export
                .iter()
                .filter(|p| p.service == service && p.metric == metric)
                .collect();
            (!points.is_empty()).then(|| {
                points
                    .iter()
                    .filter(|p| {
                        attrs
                            .iter()
                            .all(|(k, v)| p.attributes.iter().any(|(pk, pv)| pk == k && pv == v))
                    })
                    .map(|p| p.value)
                    .sum()
            })
        })
    }

    async fn wait(&self, what: &str, check: impl Fn(&Self) -> bool) {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(15);
        while !check(self) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}; points: {:?}",
                self.points()
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
}

#[tokio::test]
async fn edge_and_node_export_metrics_over_otlp() {
    bounded(async {
        let collector = Collector::default();
        let addr = collector.start().await;
        let otlp = format!("[otlp]\nendpoint = \"http://{addr}\"\ninterval_ms = 200\n");
        let pki = Pki::new(&["node-1"]);
        write_secret(&pki.path().join("key"), KEY);
        let mock = MockServer::start(MockScript::default()).await.unwrap();
        let edge = RunningEdge::start(edge_config(
            &pki,
            0,
            &format!(
                "[[providers]]\nid = \"p1\"\nnode = \"node-1\"\nadapter = \"openai\"\ntarget = \"t\"\nstall_timeout_ms = 300\n\
                 [[routes]]\nmodel = \"mock*\"\nproviders = [\"p1\"]\n\
                 [[api_keys]]\nprincipal = \"otlp\"\nkey_file = \"key\"\n{otlp}"
            ),
        ))
        .await
        .unwrap();
        let node = start_node(
            &pki,
            "node-1",
            edge.quic_addr,
            &format!(
                "[[providers]]\nadapter = \"openai\"\ntarget = \"t\"\nbase_url = \"{}\"\n{otlp}",
                mock.base_url()
            ),
        );
        ready_generation(&edge, "node-1").await;
        let http = reqwest::Client::new();
        let url = format!("http://{}/v1/chat/completions", edge.http_addr);
        let mut sent = 0.0;
        for (model, stream) in [("mock", false), ("mock", true), ("mock:stall_after=1", true)] {
            let body = format!(
                r#"{{"model":"{model}","stream":{stream},"messages":[{{"role":"user","content":"{PAYLOAD}"}}]}}"#
            );
            let _ = http
                .post(&url)
                .bearer_auth(KEY)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap()
                .text()
                .await;
            sent += 1.0;
        }
        wait_for(&edge, "idle", |s| s.leases_in_use == 0).await;

        // Periodic export: the Edge's request counter with closed labels,
        // and the Node's stall counter named after the node.
        collector
            .wait("two chat requests ok", |c| {
                c.latest("iop-edge", "iop_edge_requests", &[("route", "chat"), ("outcome", "ok")])
                    >= Some(2.0)
            })
            .await;
        collector
            .wait("the node's stall", |c| {
                c.latest("iop-node", "iop_node_response_stalls", &[])
                    >= Some(1.0)
            })
            .await;
        let points = collector.points();
        assert!(points.iter().any(|p| p.service == "iop-node" && p.instance == "node-1"));
        assert!(points.iter().any(|p| p.service == "iop-edge" && p.instance == "iop-edge"));
        assert!(
            points.iter().any(|p| p.metric == "iop_edge_request_ttft_seconds"),
            "histograms are exported"
        );

        // Graceful shutdown pushes the final counts.
        node.shutdown().await.unwrap();
        let before = collector.exports.lock().unwrap().len();
        edge.shutdown().await;
        assert!(collector.exports.lock().unwrap().len() > before, "final export at shutdown");
        let total = collector.latest("iop-edge", "iop_edge_requests", &[("route", "chat")]);
        assert_eq!(total, Some(sent), "every request is in the final export");

        // The GenAI client metrics beside them: one operation per request
        // (the stalled one with its error.type), tokens by type, and the
        // time to the first chunk of the two streamed answers.
        let genai = [
            ("gen_ai.operation.name", "chat"),
            ("gen_ai.provider.name", "openai"),
            ("gen_ai.request.model", "mock*"),
        ];
        let latest = |metric: &str, more: &[(&str, &str)]| {
            let attrs: Vec<(&str, &str)> = genai.iter().chain(more).copied().collect();
            collector.latest("iop-edge", metric, &attrs)
        };
        assert_eq!(latest("gen_ai.client.operation.duration", &[]), Some(sent));
        assert_eq!(
            latest(
                "gen_ai.client.operation.duration",
                &[("error.type", "response_stalled")]
            ),
            Some(1.0),
            "the stalled answer failed"
        );
        assert_eq!(
            latest("gen_ai.client.token.usage", &[("gen_ai.token.type", "input")]),
            Some(2.0),
            "the two answers that reported usage"
        );
        assert_eq!(
            latest("gen_ai.client.token.usage", &[("gen_ai.token.type", "output")]),
            Some(2.0)
        );
        assert_eq!(
            latest("gen_ai.client.operation.time_to_first_chunk", &[]),
            Some(2.0),
            "streamed answers only"
        );

        // R-OBS-1 over OTLP too: no key, payload or run id in anything sent.
        let raw = collector.raw.lock().unwrap().clone();
        let raw = String::from_utf8_lossy(&raw);
        for marker in [KEY, PAYLOAD, "SENTINEL", "run_id"] {
            assert!(!raw.contains(marker), "{marker} leaked into the OTLP export");
        }
        for p in collector.points() {
            for (k, v) in &p.attributes {
                // Names from the configuration and the build, not enums.
                let configured: &[&str] = match k.as_str() {
                    "provider" => &["p1"],
                    "model" | "gen_ai.request.model" => &["mock*"],
                    "target" => &["t"],
                    "version" => &[env!("CARGO_PKG_VERSION")],
                    _ => &[],
                };
                if !configured.is_empty() {
                    assert!(configured.contains(&v.as_str()), "{}: {k}={v}", p.metric);
                    continue;
                }
                assert!(
                    v.len() <= 32 && v.chars().all(|c| c.is_ascii_lowercase() || c == '_'),
                    "{}: label {k}={v} is not a closed enum value",
                    p.metric
                );
            }
        }
    })
    .await;
}
