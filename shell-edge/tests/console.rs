//! The web console over real HTTP and in a real browser: its page and
//! assets come from the binary, its sign-in turns an admin key into an
//! HttpOnly session cookie (never the key), its status and event stream
//! refuse everyone else, its streams are bounded, and what it shows is the
//! `/status` document: nodes and their connections, providers, requests in
//! flight, durable responses and the keys' limits.

mod common;

use std::time::Duration;

use common::*;
use futures::StreamExt as _;
use iop_edge::console::{MAX_STREAMS, SESSION_TTL_MS};
use iop_edge::server::RunningEdge;
use iop_node::RunningNode;
use iop_node::mock::{MockScript, MockServer};
use serde_json::{Value, json};

const ADMIN_KEY: &str = "sk-console-admin-SENTINEL-0123";
const USER_KEY: &str = "sk-console-user-SENTINEL-4567";

struct Deployment {
    pki: Pki,
    edge: RunningEdge,
    node: RunningNode,
    _mock: MockServer,
}

impl Deployment {
    async fn start() -> Self {
        let pki = Pki::new(&["node-1"]);
        write_secret(&pki.path().join("admin"), ADMIN_KEY);
        write_secret(&pki.path().join("user"), USER_KEY);
        let mock = MockServer::start(MockScript::default()).await.unwrap();
        let edge = RunningEdge::start(edge_config(
            &pki,
            0,
            "[[providers]]\nid = \"p1\"\nnode = \"node-1\"\nadapter = \"openai\"\ntarget = \"t\"\ncapacity = 4\n\
             [[routes]]\nmodel = \"mock*\"\nproviders = [\"p1\"]\n\
             [[api_keys]]\nprincipal = \"ops\"\nid = \"ops-key\"\nkey_file = \"admin\"\nadmin = true\n\
             [[api_keys]]\nprincipal = \"app\"\nid = \"app-key\"\nkey_file = \"user\"\nlimits = { requests_per_minute = 600 }\n",
        ))
        .await
        .unwrap();
        let node = start_node(
            &pki,
            "node-1",
            edge.quic_addr,
            &format!(
                "[[providers]]\nadapter = \"openai\"\ntarget = \"t\"\nbase_url = \"{}\"\n",
                mock.base_url()
            ),
        );
        ready_generation(&edge, "node-1").await;
        Deployment {
            pki,
            edge,
            node,
            _mock: mock,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.edge.http_addr)
    }
}

/// The cookie pair (`iop_console=...`) of a `Set-Cookie` header.
fn cookie_pair(set_cookie: &str) -> String {
    set_cookie.split(';').next().unwrap_or_default().to_owned()
}

async fn sign_in(http: &reqwest::Client, d: &Deployment, key: &str) -> reqwest::Response {
    http.post(d.url("/console/session"))
        .header("content-type", "application/json")
        .body(json!({ "key": key }).to_string())
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn an_admin_key_signs_in_to_a_session_cookie_and_reads_the_status_live() {
    bounded(async {
        let d = Deployment::start().await;
        let http = reqwest::Client::new();

        // The page and its assets come from the binary, with a strict
        // policy; the page itself holds no data.
        let page = http.get(d.url("/console")).send().await.unwrap();
        assert_eq!(page.status(), 200);
        let csp = page.headers()["content-security-policy"].to_str().unwrap().to_owned();
        assert!(csp.contains("script-src 'self'") && csp.contains("frame-ancestors 'none'"), "{csp}");
        assert_eq!(page.headers()["cache-control"], "no-store");
        let html = page.text().await.unwrap();
        assert!(html.contains("/console/console.js") && !html.contains("http://") && !html.contains("https://"),
            "no asset from elsewhere");
        for (path, kind) in [("/console/console.js", "text/javascript"), ("/console/console.css", "text/css")] {
            let r = http.get(d.url(path)).send().await.unwrap();
            assert_eq!(r.status(), 200, "{path}");
            assert!(r.headers()["content-type"].to_str().unwrap().starts_with(kind), "{path}");
        }

        // No data without a session or an admin key.
        for path in ["/console/status", "/console/events"] {
            let r = http.get(d.url(path)).send().await.unwrap();
            assert_eq!(r.status(), 401, "{path}");
            let r = http.get(d.url(path)).bearer_auth(USER_KEY).send().await.unwrap();
            assert_eq!(r.status(), 403, "{path} with a key without admin");
            let r = http.get(d.url(path)).header("cookie", "iop_console=forged").send().await.unwrap();
            assert_eq!(r.status(), 401, "{path} with a forged session");
        }

        // Wrong keys do not sign in, each told why; no cookie is set.
        for (key, status) in [("sk-unknown", 401), (USER_KEY, 403), ("", 401)] {
            let r = sign_in(&http, &d, key).await;
            assert_eq!(r.status(), status, "{key:?}");
            assert!(r.headers().get("set-cookie").is_none());
        }
        let r = http
            .post(d.url("/console/session"))
            .body("x".repeat(iop_edge::console::MAX_SIGN_IN_BYTES + 1))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 413, "a sign-in body is bounded");
        // A page of another site cannot sign in with a key it holds.
        let r = http
            .post(d.url("/console/session"))
            .header("origin", "http://evil.example")
            .body(json!({ "key": ADMIN_KEY }).to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403);

        // The admin key: a session cookie that the page's script cannot read
        // and no other site sends, scoped to the console, for an hour.
        let r = sign_in(&http, &d, ADMIN_KEY).await;
        assert_eq!(r.status(), 200);
        let set_cookie = r.headers()["set-cookie"].to_str().unwrap().to_owned();
        for attribute in ["HttpOnly", "SameSite=Strict", "Path=/console"] {
            assert!(set_cookie.contains(attribute), "{set_cookie}");
        }
        assert!(set_cookie.contains(&format!("Max-Age={}", SESSION_TTL_MS / 1000)), "{set_cookie}");
        assert!(!set_cookie.contains(ADMIN_KEY), "the cookie is not the key");
        let cookie = cookie_pair(&set_cookie);

        // A request and a durable response, then the status the console
        // shows: the node, the provider, the request counted, the response
        // with its owner and events, the keys by id with their limits.
        let chat = http
            .post(d.url("/v1/chat/completions"))
            .bearer_auth(USER_KEY)
            .header("content-type", "application/json")
            .body(r#"{"model":"mock:tokens=3","messages":[{"role":"user","content":"hi"}]}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(chat.status(), 200);
        let stored: Value = http
            .post(d.url("/v1/responses"))
            .bearer_auth(USER_KEY)
            .header("content-type", "application/json")
            .body(r#"{"model":"mock:tokens=4","input":"hi","store":true}"#)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let response_id = stored["id"].as_str().unwrap().to_owned();
        wait_for(&d.edge, "idle", |s| s.leases_in_use == 0 && s.waiters == 0).await;
        let r = http.get(d.url("/console/status")).header("cookie", &cookie).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let text = r.text().await.unwrap();
        assert!(!text.contains("SENTINEL"), "no key in the status");
        let doc: Value = serde_json::from_str(&text).unwrap();
        let node = &doc["nodes"][0];
        assert_eq!((&node["node"], &node["ready"]), (&json!("node-1"), &json!(true)), "{node}");
        assert!(node["generation"].is_u64() && node["connected_since"].is_u64(), "{node}");
        assert!(node["sent_packets"].as_u64() > Some(0) && node["lost_packets"].is_u64(), "{node}");
        let provider = &doc["providers"][0];
        assert_eq!((&provider["id"], &provider["overlay"]), (&json!("p1"), &json!("clear")), "{provider}");
        assert_eq!(provider["capacity"], 4);
        assert_eq!(doc["instance"]["requests_finished"], 2, "{}", doc["instance"]);
        assert_eq!(doc["instance"]["requests_ok"], 2);
        assert_eq!(doc["requests"]["in_flight"], 0);
        let recent = &doc["durable_responses"]["recent"][0];
        assert_eq!(
            recent["tag"],
            iop_core::edge::client_ids::log_tag(&response_id),
            "by its log tag: {recent}"
        );
        assert!(!text.contains(&response_id), "never by its id");
        assert_eq!(recent["status"], "completed", "{recent}");
        assert_eq!(recent["owner"], doc["instance"]["edge_id"], "this Edge writes it: {recent}");
        assert!(recent["events"].as_u64() > Some(0), "{recent}");
        let keys = doc["limits"]["keys"].as_array().unwrap();
        let app = keys.iter().find(|k| k["id"] == "app-key").expect("the app's key");
        assert_eq!((&app["principal"], &app["source"]), (&json!("app"), &json!("config")), "{app}");
        assert_eq!(app["limits"]["requests_per_minute"], 600);
        assert_eq!(doc["limits"]["keys_total"], 2);
        // The tenants' part: its store, and the keys the Edge knows.
        assert_eq!(doc["tenants"]["store_reachable"], true, "{}", doc["tenants"]);
        assert_eq!(doc["tenants"]["keys"]["config_keys"], 2, "{}", doc["tenants"]);
        // The same document as `/status` (one place gathers it).
        let status: Value = http.get(d.url("/status")).bearer_auth(ADMIN_KEY).send().await.unwrap().json().await.unwrap();
        assert_eq!(status["limits"], doc["limits"]);
        assert_eq!(status["nodes"][0]["node"], "node-1");

        // Live: a `status` event at once, then one about every second; a
        // slow stream shows up in flight with its phase and attempt.
        let events = http.get(d.url("/console/events")).header("cookie", &cookie).send().await.unwrap();
        assert_eq!(events.status(), 200);
        assert_eq!(events.headers()["content-type"], "text/event-stream");
        let mut body = events.bytes_stream();
        let slow = {
            let (http, url) = (http.clone(), d.url("/v1/chat/completions"));
            tokio::spawn(async move {
                http.post(url)
                    .bearer_auth(USER_KEY)
                    .header("content-type", "application/json")
                    .body(r#"{"model":"mock:tokens=200,tps=50","stream":true,"messages":[{"role":"user","content":"hi"}]}"#)
                    .send()
                    .await
                    .and_then(|r| r.error_for_status())
            })
        };
        let mut seen = String::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let running = loop {
            let chunk = tokio::time::timeout_at(deadline, body.next())
                .await
                .expect("a running, committed request within 10 s")
                .expect("the stream goes on")
                .unwrap();
            seen.push_str(&String::from_utf8_lossy(&chunk));
            let docs: Vec<Value> = seen
                .split("\n\n")
                .filter(|e| e.contains("event: status"))
                .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
                .filter_map(|data| serde_json::from_str(data).ok())
                .collect();
            if let Some(row) = docs
                .iter()
                .filter_map(|doc| doc["requests"]["listed"].as_array())
                .flatten()
                .find(|r| r["phase"] == "running" && r["committed"] == true)
            {
                break row.clone();
            }
        };
        assert_eq!((&running["route"], &running["model"]), (&json!("chat"), &json!("mock:tokens=200,tps=50")), "{running}");
        assert_eq!((&running["attempt"], &running["provider"]), (&json!(1), &json!("p1")), "{running}");
        drop(body);
        slow.await.unwrap().unwrap();

        // Signing out ends the session.
        let r = http.delete(d.url("/console/session")).header("cookie", &cookie).send().await.unwrap();
        assert_eq!(r.status(), 204);
        assert!(r.headers()["set-cookie"].to_str().unwrap().contains("Max-Age=0"));
        let r = http.get(d.url("/console/status")).header("cookie", &cookie).send().await.unwrap();
        assert_eq!(r.status(), 401);

        let _ = d.node.shutdown().await;
        d.edge.shutdown().await;
        drop(d.pki);
    })
    .await;
}

#[tokio::test]
async fn console_streams_are_bounded_and_end_when_the_edge_stops() {
    bounded(async {
        let d = Deployment::start().await;
        let http = reqwest::Client::new();
        let open = || {
            http.get(d.url("/console/events"))
                .bearer_auth(ADMIN_KEY)
                .send()
        };
        let mut streams = Vec::new();
        for _ in 0..MAX_STREAMS {
            let r = open().await.unwrap();
            assert_eq!(r.status(), 200);
            streams.push(r.bytes_stream());
        }
        let refused = open().await.unwrap();
        assert_eq!(refused.status(), 429, "one past the bound");
        assert_eq!(refused.headers()["retry-after"], "5");
        let body: Value = refused.json().await.unwrap();
        assert_eq!(body["error"]["code"], "console_streams_full");

        // One closes: its place is free again.
        drop(streams.pop());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let reopened = loop {
            let r = open().await.unwrap();
            if r.status() == 200 {
                break r;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "a freed place is taken again"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        streams.push(reopened.bytes_stream());

        // Shutdown ends every stream at once; it does not wait out the
        // drain (2 s here) for them.
        let _ = d.node.shutdown().await;
        let started = tokio::time::Instant::now();
        d.edge.shutdown().await;
        assert!(
            started.elapsed() < Duration::from_millis(1_500),
            "took {:?}",
            started.elapsed()
        );
        for mut s in streams {
            let ended = tokio::time::timeout(Duration::from_secs(2), async {
                while let Some(Ok(_)) = s.next().await {}
            })
            .await;
            assert!(ended.is_ok(), "every stream ended");
        }
    })
    .await;
}

/// The console in Debian's chromium, driven by selenium (see
/// `tests/console/console_browser.py`). CI installs chromium,
/// chromium-driver and selenium (see `.ci/run`) and sets
/// `IOP_BROWSER_PYTHON`; elsewhere the test uses `python3` if it can
/// import `selenium` and chromium is installed, and says so if not.
#[tokio::test]
async fn the_console_in_a_real_browser_signs_in_and_follows_the_edge() {
    let python = match std::env::var("IOP_BROWSER_PYTHON") {
        Ok(p) => p,
        Err(_) => {
            assert!(
                std::env::var("CI").is_err(),
                "CI must provide IOP_BROWSER_PYTHON (a python with selenium)"
            );
            let ok = std::process::Command::new("python3")
                .args(["-c", "import selenium"])
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                eprintln!("selenium not installed locally; run .ci/run to exercise this test");
                return;
            }
            "python3".into()
        }
    };
    for tool in ["/usr/bin/chromium", "/usr/bin/chromedriver"] {
        if !std::path::Path::new(tool).exists() {
            assert!(
                std::env::var("CI").is_err(),
                "CI must install Debian's chromium and chromium-driver ({tool})"
            );
            eprintln!("{tool} not installed locally; run .ci/run to exercise this test");
            return;
        }
    }
    tokio::time::timeout(Duration::from_secs(120), async {
        let d = Deployment::start().await;
        let shots = tempfile::tempdir().unwrap();
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/console/console_browser.py"
        );
        let mut child = tokio::process::Command::new(&python)
            .arg(script)
            .arg(format!("http://{}", d.edge.http_addr))
            .arg(ADMIN_KEY)
            .arg(USER_KEY)
            .arg(shots.path())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("run python");
        let mut stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
        let mut said = String::new();
        let mut node = Some(d.node);
        while let Some(line) = lines.next_line().await.unwrap() {
            said.push_str(&line);
            said.push('\n');
            if line == "KILL-NODE" {
                // As a crash: no goodbye, the Edge finds out by the heartbeat.
                if let Some(node) = node.take() {
                    node.abort();
                }
                tokio::io::AsyncWriteExt::write_all(&mut stdin, b"killed\n")
                    .await
                    .unwrap();
            }
        }
        let out = child.wait_with_output().await.unwrap();
        assert!(
            out.status.success(),
            "console browser test failed:\n{said}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(node.is_none(), "the script asked for the node to go");
        for shot in ["console-desktop.png", "console-phone.png"] {
            let bytes = std::fs::read(shots.path().join(shot)).unwrap();
            assert!(bytes.starts_with(b"\x89PNG"), "{shot} is a PNG");
        }
        d.edge.shutdown().await;
        drop(d.pki);
    })
    .await
    .expect("the browser test exceeded its 120 s bound");
}
