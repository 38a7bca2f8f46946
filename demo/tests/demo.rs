//! The demo as a user runs it: the `iop-demo` process starts an Edge and a
//! Node with the built-in mock provider, prints a base URL and an API key
//! that answer a chat completion at once, keeps its key across runs, and
//! stops cleanly on SIGINT.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};

/// A loopback UDP port nobody holds now (the demo's QUIC listener).
fn free_udp_port() -> u16 {
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    udp.local_addr().unwrap().port()
}

/// What the demo printed before "Ctrl-C to stop.".
struct Printed {
    base_url: String,
    key: String,
    text: String,
}

/// Start the demo in `dir` (never Ollama) and read its banner.
async fn start(dir: &std::path::Path) -> (tokio::process::Child, Printed) {
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_iop-demo"))
        .arg("--dir")
        .arg(dir)
        .args(["--http-listen", "127.0.0.1:0", "--ollama", ""])
        .arg("--quic-listen")
        .arg(format!("127.0.0.1:{}", free_udp_port()))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn iop-demo");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut text = String::new();
    let banner = async {
        while let Some(line) = lines.next_line().await.unwrap() {
            text.push_str(&line);
            text.push('\n');
            if line == "Ctrl-C to stop." {
                return;
            }
        }
        panic!("the demo exited before it was ready:\n{text}");
    };
    tokio::time::timeout(Duration::from_secs(60), banner)
        .await
        .expect("the demo did not print its banner within 60 s");
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.trim().strip_prefix(name))
            .and_then(|rest| rest.trim().strip_prefix(':'))
            .map(|v| v.trim().to_owned())
            .unwrap_or_else(|| panic!("no `{name}` in:\n{text}"))
    };
    let printed = Printed {
        base_url: field("base URL"),
        key: field("API key"),
        text: text.clone(),
    };
    (child, printed)
}

/// SIGINT, as Ctrl-C sends, then the exit status and what went to stderr.
async fn interrupt(mut child: tokio::process::Child) -> (std::process::ExitStatus, String) {
    let pid = child.id().expect("running").to_string();
    let sent = std::process::Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .expect("run kill");
    assert!(sent.success());
    let mut stderr = child.stderr.take().unwrap();
    let mut err = String::new();
    let status = tokio::time::timeout(Duration::from_secs(30), async {
        tokio::io::AsyncReadExt::read_to_string(&mut stderr, &mut err)
            .await
            .unwrap();
        child.wait().await.unwrap()
    })
    .await
    .expect("the demo did not stop within 30 s of SIGINT");
    (status, err)
}

#[tokio::test]
async fn the_printed_url_and_key_answer_and_sigint_stops_it() {
    let dir = tempfile::tempdir().unwrap();
    let (child, printed) = start(dir.path()).await;
    assert!(
        printed.text.contains("serving the built-in mock provider"),
        "{}",
        printed.text
    );
    assert!(printed.text.contains("models   : mock"), "{}", printed.text);
    assert!(printed.key.starts_with("iop-demo-"), "{}", printed.text);

    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::new();
    let body = r#"{"model":"mock","messages":[{"role":"user","content":"hello"}],"stream":true}"#;
    let resp = client
        .post(format!("{}/chat/completions", printed.base_url))
        .bearer_auth(&printed.key)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let sse = resp.text().await.unwrap();
    assert!(sse.contains("chat.completion.chunk"), "{sse}");
    assert!(sse.trim_end().ends_with("data: [DONE]"), "{sse}");

    // A wrong key is refused.
    let resp = client
        .get(format!("{}/models", printed.base_url))
        .bearer_auth("not-the-key")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);

    let (status, stderr) = interrupt(child).await;
    assert!(status.success(), "{status}\n{stderr}");
    assert!(stderr.contains("stopping"), "{stderr}");

    // A second run in the same directory keeps the certificates and the key.
    let (child, again) = start(dir.path()).await;
    assert_eq!(again.key, printed.key);
    let (status, stderr) = interrupt(child).await;
    assert!(status.success(), "{status}\n{stderr}");
    assert!(!stderr.contains("generated dev certificates"), "{stderr}");
}
