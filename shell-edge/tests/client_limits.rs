//! Client connections and bodies under hostile input (SPEC §7, R-LIM-1,
//! R-LIM-2), on loopback against a real Edge: raw TCP for the attackers, a
//! real HTTP client for the legitimate one.

mod common;

use std::time::Duration;

use common::*;
use iop_edge::server::RunningEdge;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

const KEY: &str = "sk-client-limits-test-0123456789";

/// The HTTP/2 connection preface.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

async fn edge(edge_lines: &str) -> (Pki, RunningEdge) {
    let pki = Pki::new(&["node-1"]);
    write_secret(&pki.path().join("key"), KEY);
    let edge = RunningEdge::start(edge_config_with(
        &pki,
        0,
        edge_lines,
        "[[providers]]\nid = \"p1\"\nnode = \"node-1\"\nadapter = \"mock\"\ntarget = \"m\"\nmodels = [\"mock*\"]\n\
         [[api_keys]]\nprincipal = \"t\"\nkey_file = \"key\"\n",
    ))
    .await
    .unwrap();
    (pki, edge)
}

async fn connect(edge: &RunningEdge) -> TcpStream {
    TcpStream::connect(edge.http_addr).await.unwrap()
}

/// A connection from loopback source address 127.0.0.`host` (every
/// 127.0.0.0/8 address is local on Linux): another client to the Edge.
async fn connect_from(edge: &RunningEdge, host: u8) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket
        .bind(std::net::SocketAddr::from(([127, 0, 0, host], 0)))
        .unwrap();
    socket.connect(edge.http_addr).await.unwrap()
}

/// Read until the Edge closes the connection (EOF or reset); everything
/// read, and when it closed. Panics if it stays open for `bound`.
async fn until_closed(tcp: &mut TcpStream, bound: Duration) -> (Vec<u8>, Instant) {
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + bound;
    loop {
        match tokio::time::timeout_at(deadline, tcp.read(&mut buf)).await {
            Err(_) => panic!("the connection stayed open for {bound:?}; read {seen:?}"),
            Ok(Ok(0) | Err(_)) => return (seen, Instant::now()),
            Ok(Ok(n)) => seen.extend_from_slice(&buf[..n]),
        }
    }
}

/// A chat request whose head is complete and whose body never ends: a
/// request in flight on its connection.
async fn busy_connection(edge: &RunningEdge) -> TcpStream {
    busy_connection_from(edge, 1).await
}

/// [`busy_connection`] from 127.0.0.`host`.
async fn busy_connection_from(edge: &RunningEdge, host: u8) -> TcpStream {
    let mut tcp = connect_from(edge, host).await;
    tcp.write_all(
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n\
             content-type: application/json\r\ncontent-length: 100\r\n\r\n{{\"model\":"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    tcp
}

/// The legitimate client: a fresh connection, `/healthz`, within 5 s.
async fn healthz(edge: &RunningEdge) -> reqwest::StatusCode {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    client
        .get(format!("http://{}/healthz", edge.http_addr))
        .send()
        .await
        .expect("the legitimate client is answered")
        .status()
}

/// HTTP/2 frames as (type, flags, stream) from raw bytes.
fn h2_frames(bytes: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
    let mut frames = Vec::new();
    let mut rest = bytes;
    while rest.len() >= 9 {
        let len = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
        if rest.len() < 9 + len {
            break;
        }
        let stream = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]) & 0x7fff_ffff;
        frames.push((rest[3], rest[4], stream, rest[9..9 + len].to_vec()));
        rest = &rest[9 + len..];
    }
    frames
}

/// Preface, empty SETTINGS, and `GET /healthz` on stream 1 (HPACK literals
/// and static-table indices only).
fn h2_get_healthz() -> Vec<u8> {
    let mut out = H2_PREFACE.to_vec();
    out.extend_from_slice(&[0, 0, 0, 0x4, 0, 0, 0, 0, 0]);
    let mut block = vec![0x82, 0x86]; // :method GET, :scheme http
    block.push(0x44); // :path, literal value
    block.push(8);
    block.extend_from_slice(b"/healthz");
    block.push(0x41); // :authority, literal value
    block.push(1);
    block.push(b'x');
    let len = block.len();
    // HEADERS, END_STREAM | END_HEADERS, stream 1.
    out.extend_from_slice(&[0, 0, len as u8, 0x1, 0x5, 0, 0, 0, 1]);
    out.extend_from_slice(&block);
    out
}

/// Waits (bounded) until `/metrics` shows `series` (a line prefix, labels
/// included) at `want` or more, and returns its value. The scrape takes a
/// connection of its own, so the caller frees room first.
async fn metric_reaches(edge: &RunningEdge, series: &str, want: f64) -> f64 {
    let url = format!("http://{}/metrics", edge.http_addr);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let value = match reqwest::get(&url).await {
            Ok(r) if r.status() == 200 => r
                .text()
                .await
                .unwrap()
                .lines()
                .filter(|l| l.starts_with(series))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum(),
            _ => 0.0,
        };
        if value >= want || Instant::now() > deadline {
            return value;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn idle_connections_at_the_cap_do_not_keep_a_client_out() {
    // R-LIM-1: the cap is never a silent wait; idle holders make room.
    bounded(async {
        // Only the cap is set: the same test runs against an Edge without
        // the other limits (where it hangs).
        let (_pki, edge) = edge("max_connections = 6").await;
        let mut idle = Vec::new();
        for _ in 0..3 {
            idle.push(connect(&edge).await);
        }
        for _ in 0..3 {
            let mut half = connect(&edge).await;
            half.write_all(&H2_PREFACE[..10]).await.unwrap();
            idle.push(half);
        }
        // Let the Edge accept all six before the client comes.
        tokio::time::sleep(Duration::from_millis(100)).await;
        for _ in 0..3 {
            assert_eq!(healthz(&edge).await, 200);
        }
        // The oldest silent holder was closed to make room.
        let (_, _) = until_closed(&mut idle[0], Duration::from_secs(5)).await;
        // Counted: every connection admitted, and the idle ones closed for
        // newcomers.
        let evicted = metric_reaches(&edge, "iop_edge_client_connections_evicted_total", 1.0).await;
        assert!(evicted >= 1.0, "{evicted}");
        let admitted = metric_reaches(
            &edge,
            "iop_edge_client_connections_total{outcome=\"admitted\"",
            7.0,
        )
        .await;
        assert!(admitted >= 7.0, "{admitted}");
        edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn silent_half_preface_and_slow_head_connections_are_closed_in_time() {
    // R-LIM-1: first byte, protocol detection and headers are bounded.
    bounded(async {
        let (_pki, edge) = edge("first_request_timeout_ms = 300").await;
        let mut silent = connect(&edge).await;
        let mut half_h2 = connect(&edge).await;
        half_h2.write_all(&H2_PREFACE[..16]).await.unwrap();
        let mut slow_head = connect(&edge).await;
        slow_head
            .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")
            .await
            .unwrap();
        let started = Instant::now();
        for tcp in [&mut silent, &mut half_h2, &mut slow_head] {
            let (_, closed) = until_closed(tcp, Duration::from_secs(5)).await;
            assert!(closed - started >= Duration::from_millis(250));
        }
        assert_eq!(healthz(&edge).await, 200);
        edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn past_the_cap_with_every_connection_busy_a_newcomer_gets_a_fast_503() {
    // R-LIM-1: an answer, never a wait.
    bounded(async {
        let (_pki, edge) = edge("max_connections = 2\nbody_read_timeout_ms = 30000").await;
        // Three clients, each under its share (a quarter of the cap, so
        // one connection): the cap, not a share, turns the third away.
        let a = busy_connection_from(&edge, 1).await;
        let b = busy_connection_from(&edge, 2).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut late = connect_from(&edge, 3).await;
        let (answer, _) = until_closed(&mut late, Duration::from_secs(2)).await;
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");
        assert!(answer.contains("too_many_connections"), "{answer}");
        // Counted as refused by the cap (room made first for the scrape).
        drop((a, b));
        let series = "iop_edge_client_connections_total{outcome=\"cap\"";
        assert_eq!(metric_reaches(&edge, series, 1.0).await, 1.0);
        edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn one_source_address_is_held_to_its_share_of_the_cap() {
    // R-LIM-1: one source cannot take more than its share.
    bounded(async {
        let (_pki, edge) = edge(
            "max_connections = 8\nmax_connections_per_source = 2\nbody_read_timeout_ms = 30000",
        )
        .await;
        let a = busy_connection(&edge).await;
        let b = busy_connection(&edge).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut third = connect(&edge).await;
        let (answer, _) = until_closed(&mut third, Duration::from_secs(2)).await;
        assert!(answer.starts_with(b"HTTP/1.1 503 "));
        // Counted as refused by the source's share, not the cap.
        drop((a, b));
        let share = "iop_edge_client_connections_total{outcome=\"source_share\"";
        assert_eq!(metric_reaches(&edge, share, 1.0).await, 1.0);
        let cap = "iop_edge_client_connections_total{outcome=\"cap\"";
        assert_eq!(metric_reaches(&edge, cap, 0.0).await, 0.0);
        edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn idle_keep_alive_connections_close_after_the_idle_timeout_http1_and_http2() {
    // R-LIM-1: idleness is bounded for both protocols.
    bounded(async {
        let (_pki, edge) = edge("idle_timeout_ms = 300\nh2_max_concurrent_streams = 7").await;
        let mut h1 = connect(&edge).await;
        h1.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut h2 = connect(&edge).await;
        h2.write_all(&h2_get_healthz()).await.unwrap();
        let started = Instant::now();
        let (seen, closed) = until_closed(&mut h1, Duration::from_secs(5)).await;
        assert!(seen.starts_with(b"HTTP/1.1 200 "), "{seen:?}");
        assert!(closed - started >= Duration::from_millis(250));
        let (seen, closed) = until_closed(&mut h2, Duration::from_secs(5)).await;
        assert!(closed - started >= Duration::from_millis(250));
        let frames = h2_frames(&seen);
        // The server's SETTINGS carry the stream limit (id 3).
        let settings = &frames.iter().find(|f| f.0 == 0x4 && f.1 == 0).unwrap().3;
        let limit = settings
            .chunks(6)
            .find(|s| s[..2] == [0, 3])
            .map(|s| u32::from_be_bytes([s[2], s[3], s[4], s[5]]));
        assert_eq!(limit, Some(7), "{frames:?}");
        assert!(
            frames.iter().any(|f| f.0 == 0x1 && f.2 == 1),
            "the request was answered: {frames:?}"
        );
        edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn a_connection_stops_at_its_maximum_age_http1_and_http2() {
    // R-LIM-1: age is bounded even for a client that keeps sending.
    bounded(async {
        let (_pki, edge) = edge("max_connection_age_ms = 400\nidle_timeout_ms = 30000").await;
        let started = Instant::now();
        let mut h1 = connect(&edge).await;
        let mut h2 = connect(&edge).await;
        h2.write_all(&h2_get_healthz()).await.unwrap();
        // The HTTP/1 client keeps its connection busy with requests.
        let mut answered = 0;
        let mut buf = [0u8; 4096];
        loop {
            if h1
                .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
                .await
                .is_err()
            {
                break;
            }
            match tokio::time::timeout(Duration::from_secs(5), h1.read(&mut buf)).await {
                Ok(Ok(0) | Err(_)) => break,
                Ok(Ok(_)) => answered += 1,
                Err(_) => panic!("the connection neither answered nor closed"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let age = started.elapsed();
        assert!(answered >= 2, "{answered}");
        assert!(
            age >= Duration::from_millis(350) && age < Duration::from_secs(5),
            "{age:?}"
        );
        // HTTP/2 gets a GOAWAY (the close follows the client's PING ack,
        // or the age grace).
        let mut seen = Vec::new();
        while !h2_frames(&seen).iter().any(|f| f.0 == 0x7) {
            let n = tokio::time::timeout(Duration::from_secs(5), h2.read(&mut buf))
                .await
                .expect("a GOAWAY at the maximum age")
                .unwrap();
            assert!(n > 0, "closed without a GOAWAY: {seen:?}");
            seen.extend_from_slice(&buf[..n]);
        }
        edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn a_body_that_stops_arriving_gets_408_and_frees_its_budget() {
    // R-LIM-2: each body read has a timeout.
    bounded(async {
        let (_pki, edge) = edge("body_read_timeout_ms = 300").await;
        let mut tcp = busy_connection(&edge).await;
        let (answer, _) = until_closed(&mut tcp, Duration::from_secs(5)).await;
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 408 "), "{answer}");
        edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn bodies_in_flight_are_bounded_in_total_and_refused_fast_beyond() {
    // R-LIM-2: the budget is taken before the body is read.
    bounded(async {
        let (_pki, edge) = edge(
            "max_body_bytes = 1000\nrequest_memory_bytes = 24000\nrequest_memory_bytes_per_key = 24000\nbody_read_timeout_ms = 30000",
        )
        .await;
        let head = |len: usize| {
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n\
                 content-type: application/json\r\ncontent-length: {len}\r\n\r\n"
            )
        };
        let mut holder = connect(&edge).await;
        holder.write_all(head(1000).as_bytes()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut refused = connect(&edge).await;
        refused.write_all(head(1000).as_bytes()).await.unwrap();
        let mut buf = vec![0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(2), refused.read(&mut buf))
            .await
            .expect("a fast answer")
            .unwrap();
        let answer = String::from_utf8_lossy(&buf[..n]);
        assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");
        assert!(answer.contains("server_busy"), "{answer}");
        // A small body still fits beside the holder.
        let r = reqwest::Client::new()
            .post(format!("http://{}/v1/chat/completions", edge.http_addr))
            .bearer_auth(KEY)
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "parsed (and refused as invalid), not 503");
        // A declared length over the limit is refused before any body byte.
        let mut big = connect(&edge).await;
        big.write_all(head(1001).as_bytes()).await.unwrap();
        let n = tokio::time::timeout(Duration::from_secs(2), big.read(&mut buf))
            .await
            .expect("a fast answer")
            .unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 413 "));
        edge.shutdown().await;
    })
    .await;
}

/// R-LIM-2, accounted as decoded: a body of small objects (each would
/// become a map node of hundreds of bytes) is refused 413 unparsed, while
/// text of the same length is parsed; neither takes the budget from the
/// other.
#[tokio::test]
async fn a_body_is_charged_what_it_decodes_to_r_lim_2() {
    bounded(async {
        let (_pki, edge) = edge(
            "max_body_bytes = 100000\nrequest_memory_bytes = 4000000\nrequest_memory_bytes_per_key = 4000000",
        )
        .await;
        let post = |body: String| {
            reqwest::Client::new()
                .post(format!("http://{}/v1/chat/completions", edge.http_addr))
                .bearer_auth(KEY)
                .header("content-type", "application/json")
                .body(body)
                .send()
        };
        let mut objects = String::from(r#"{"model":"nope","messages":["#);
        while objects.len() < 90_000 {
            objects.push_str(r#"{"":0},"#);
        }
        objects.push_str("0]}");
        let r = post(objects.clone()).await.unwrap();
        assert_eq!(r.status(), 413);
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "request_too_complex", "{v}");
        let text = format!(
            r#"{{"model":"nope","messages":[{{"role":"user","content":"{}"}}]}}"#,
            "x".repeat(objects.len() - 60)
        );
        let r = post(text).await.unwrap();
        assert_eq!(r.status(), 404, "parsed: the model does not exist");
        edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn a_client_that_leaves_mid_body_is_counted_as_disconnected_not_413() {
    // R-LIM-2: a client abort is not a body-too-large.
    bounded(async {
        let (_pki, edge) = edge("body_read_timeout_ms = 30000").await;
        let tcp = busy_connection(&edge).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(tcp);
        let url = format!("http://{}/metrics", edge.http_addr);
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let text = reqwest::get(&url).await.unwrap().text().await.unwrap();
            // Every series exists from the start at 0: read the counts.
            let count = |outcome: &str| -> f64 {
                text.lines()
                    .filter(|l| {
                        l.starts_with("iop_edge_requests_total{")
                            && l.contains("route=\"chat\"")
                            && l.contains(&format!("outcome=\"{outcome}\""))
                    })
                    .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                    .sum()
            };
            if count("client_disconnected") > 0.0 {
                assert_eq!(count("invalid_request"), 0.0, "{text}");
                break;
            }
            assert!(Instant::now() < deadline, "no request counted: {text}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        edge.shutdown().await;
    })
    .await;
}
