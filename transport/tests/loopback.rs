//! Real quinn on loopback with certificates generated into a tempdir.
//!
//! No test sleeps: every wait is on an event (a handshake, a frame, a stop,
//! a close), and each test body runs under a generous timeout so a
//! regression fails instead of hanging.

use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use iop_transport::framed::{FramedError, FramedRecv, FramedSend, accept_framed, open_framed};
use iop_transport::pki::{IssuedCert, generate_ca, issue_client_cert_without_node_identity};
use iop_transport::tls::crypto_provider;
use iop_transport::{
    CertDenylist, ClientTls, DevPki, IdentityError, QuicTuning, ServerTls, TransportError,
    Validity, client_endpoint, close_code_of, close_connection, connect, generate_dev_pki,
    issue_node_cert, load_ca, peer_node_id, server_endpoint_with_denylist,
};
use iop_wire::{
    AdapterKind, CloseCode, EdgeControl, Heartbeat, NodeControl, OfferedProvider, RegisterRequest,
    StreamErrorCode, WireError,
};
use quinn::{ConnectionError, TransportErrorCode};
use rustls::AlertDescription;

const TEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Run a test body, failing (not hanging) if it never completes.
async fn within_timeout<F: Future<Output = ()>>(body: F) {
    if tokio::time::timeout(TEST_TIMEOUT, body).await.is_err() {
        panic!("test did not complete within {TEST_TIMEOUT:?}");
    }
}

/// A dev PKI in a tempdir, and the Edge listening on 127.0.0.1:0.
struct Deployment {
    _dir: tempfile::TempDir,
    pki: DevPki,
    ca_cert_pem: String,
    ca_key_pem: String,
    edge: quinn::Endpoint,
    edge_addr: SocketAddr,
}

impl Deployment {
    fn start(node_ids: &[&str]) -> Self {
        Self::start_with_denylist(node_ids, CertDenylist::default())
    }

    fn start_with_denylist(node_ids: &[&str], denylist: CertDenylist) -> Self {
        Self::start_tuned(node_ids, denylist, &QuicTuning::default())
    }

    fn start_tuned(node_ids: &[&str], denylist: CertDenylist, tuning: &QuicTuning) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let pki = generate_dev_pki(dir.path(), node_ids, &["edge.test"]).expect("dev pki");
        let ca_cert_pem = std::fs::read_to_string(&pki.ca_cert).expect("read ca.pem");
        let ca_key_pem = std::fs::read_to_string(&pki.ca_key).expect("read ca.key");
        let server_tls =
            ServerTls::from_files(&pki.edge_cert, &pki.edge_key, &pki.ca_cert).expect("edge tls");
        let edge = server_endpoint_with_denylist(
            &server_tls,
            SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            tuning,
            denylist,
        )
        .expect("edge endpoint");
        let edge_addr = edge.local_addr().expect("edge addr");
        Self {
            _dir: dir,
            pki,
            ca_cert_pem,
            ca_key_pem,
            edge,
            edge_addr,
        }
    }

    /// The TLS config of a Node whose files `generate_dev_pki` wrote.
    fn node_tls(&self, node_id: &str) -> ClientTls {
        let files = self.pki.node(node_id).expect("node was generated");
        ClientTls::from_files(&files.cert, &files.key, &self.pki.ca_cert).expect("node tls")
    }

    /// A client that trusts the deployment CA but presents `issued`.
    fn client_tls_presenting(&self, issued: &IssuedCert) -> ClientTls {
        let cert_chain = vec![issued.cert_der().expect("issued cert der")];
        let key = rustls::pki_types::pem::PemObject::from_pem_slice(issued.key_pem.as_bytes())
            .expect("issued key");
        ClientTls {
            cert_chain,
            key,
            server_ca: load_ca(&self.pki.ca_cert).expect("ca"),
        }
    }

    /// Connect a Node with `tls` while the Edge accepts: (edge side, node side).
    async fn handshake(
        &self,
        tls: &ClientTls,
    ) -> (
        Result<quinn::Connection, ConnectionError>,
        Result<quinn::Connection, TransportError>,
    ) {
        let node = client_endpoint(tls, &QuicTuning::default()).expect("node endpoint");
        self.handshake_from(&node).await
    }

    async fn handshake_from(
        &self,
        node: &quinn::Endpoint,
    ) -> (
        Result<quinn::Connection, ConnectionError>,
        Result<quinn::Connection, TransportError>,
    ) {
        let accept = async {
            let incoming = self.edge.accept().await.expect("edge endpoint open");
            incoming.await
        };
        tokio::join!(accept, connect(node, self.edge_addr, "localhost"))
    }

    /// Both sides of an accepted mutual-TLS connection for `node_id`.
    async fn connected(&self, node_id: &str) -> (quinn::Connection, quinn::Connection) {
        let (edge, node) = self.handshake(&self.node_tls(node_id)).await;
        (edge.expect("edge accepts"), node.expect("node connects"))
    }
}

/// The TLS alert the Edge sends when it refuses a client certificate, as a
/// QUIC transport error code.
fn alert_code(alert: AlertDescription) -> TransportErrorCode {
    TransportErrorCode::crypto(u8::from(alert))
}

/// The Edge side failed at `incoming.await` with `alert`.
fn assert_edge_refused(edge: Result<quinn::Connection, ConnectionError>, alert: AlertDescription) {
    match edge {
        Err(ConnectionError::TransportError(error)) => {
            assert_eq!(error.code, alert_code(alert), "edge error: {error}")
        }
        Err(other) => panic!("edge failed with an unexpected error: {other}"),
        Ok(_) => panic!("edge accepted a connection it must refuse"),
    }
}

/// The Node's view of a refusal: TLS 1.3 lets the client finish its side
/// of the handshake, so the refusal shows up on the first stream I/O.
async fn assert_node_sees_refusal(
    node: Result<quinn::Connection, TransportError>,
    alert: AlertDescription,
) {
    // In TLS 1.3 the client's handshake completes before the server has
    // checked the client certificate: `connect` succeeds.
    let conn = match node {
        Ok(conn) => conn,
        Err(error) => panic!("the refusal must show late, not at connect: {error}"),
    };
    let error = first_stream_io_error(&conn).await;
    match &error {
        FramedError::ConnectionLost { source, close_code } => {
            assert_eq!(*close_code, None, "a TLS refusal is not an app close");
            assert_closed_with_alert(source, alert);
        }
        other => panic!("node's first stream I/O failed unexpectedly: {other}"),
    }
    assert!(error.is_peer_fault());
}

fn assert_closed_with_alert(error: &ConnectionError, alert: AlertDescription) {
    match error {
        ConnectionError::ConnectionClosed(close) => {
            assert_eq!(close.error_code, alert_code(alert), "node saw: {close}")
        }
        other => panic!("node saw an unexpected close: {other}"),
    }
}

/// Open a stream, send a Register-like ping and read: one of them fails.
async fn first_stream_io_error(conn: &quinn::Connection) -> FramedError {
    let (mut send, mut recv) = match open_framed(conn).await {
        Ok(halves) => halves,
        Err(error) => return error,
    };
    if let Err(error) = send.send(&NodeControl::Ping(Heartbeat { seq: 1 })).await {
        return error;
    }
    match recv.recv::<EdgeControl>().await {
        Err(error) => error,
        Ok(answer) => panic!("a refused node got an answer: {answer:?}"),
    }
}

fn register_request(model_count: usize) -> RegisterRequest {
    RegisterRequest {
        protocol_version: iop_wire::PROTOCOL_VERSION,
        node_version: "0.1.0-test".into(),
        providers: vec![OfferedProvider {
            adapter: AdapterKind::Ollama,
            target: "http://127.0.0.1:11434".into(),
            models: (0..model_count)
                .map(|i| format!("model-{i:06}-with-a-longer-name"))
                .collect(),
            max_concurrent_runs: None,
        }],
        max_concurrent_runs: 64,
        recipient_public_key: Some([7; 32]),
        parked: Vec::new(),
    }
}

#[tokio::test]
async fn mutual_tls_connects_and_edge_reads_node_id_from_certificate() {
    within_timeout(async {
        let deployment = Deployment::start(&["node-a", "node-b"]);
        let (edge_conn, node_conn) = deployment.connected("node-b").await;

        assert_eq!(peer_node_id(&edge_conn), Ok("node-b".to_owned()));
        for conn in [&edge_conn, &node_conn] {
            let handshake = conn
                .handshake_data()
                .and_then(|data| data.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
                .expect("rustls handshake data");
            assert_eq!(handshake.protocol.as_deref(), Some(iop_wire::ALPN));
        }
        // The Edge's own certificate carries no node identity.
        assert_eq!(peer_node_id(&node_conn), Err(IdentityError::NoNodeIdentity));

        // And the connection carries frames both ways.
        let (mut node_send, mut node_recv) = open_framed(&node_conn).await.expect("open");
        node_send
            .send(&NodeControl::Ping(Heartbeat { seq: 9 }))
            .await
            .expect("ping");
        let (mut edge_send, mut edge_recv) = accept_framed(&edge_conn).await.expect("accept");
        assert_eq!(
            edge_recv.recv::<NodeControl>().await.expect("recv"),
            Some(NodeControl::Ping(Heartbeat { seq: 9 }))
        );
        edge_send
            .send(&EdgeControl::Pong(Heartbeat { seq: 9 }))
            .await
            .expect("pong");
        assert_eq!(
            node_recv.recv::<EdgeControl>().await.expect("recv"),
            Some(EdgeControl::Pong(Heartbeat { seq: 9 }))
        );
    })
    .await;
}

#[tokio::test]
async fn client_certificate_from_another_ca_is_rejected() {
    within_timeout(async {
        let deployment = Deployment::start(&[]);
        let validity = Validity::from_now(Duration::from_secs(3600));
        // Another deployment's dev CA has the same name as ours, so webpki
        // tries our CA as the issuer and the signature fails; a CA with a
        // name of its own is simply unknown. Both are refused.
        let rogue_dir = tempfile::tempdir().expect("tempdir");
        let same_name = generate_dev_pki(rogue_dir.path(), &[], &[]).expect("rogue pki");
        let same_name_ca = IssuedCert {
            cert_pem: std::fs::read_to_string(&same_name.ca_cert).expect("rogue ca.pem"),
            key_pem: std::fs::read_to_string(&same_name.ca_key).expect("rogue ca.key"),
        };
        let other_name_ca = generate_ca("someone else's CA", validity).expect("rogue ca");
        for (rogue_ca, alert) in [
            (same_name_ca, AlertDescription::DecryptError),
            (other_name_ca, AlertDescription::UnknownCA),
        ] {
            // Trusts the real CA (so it verifies the Edge) but presents a
            // certificate from the rogue CA with a plausible node id.
            let rogue_node =
                issue_node_cert(&rogue_ca.cert_pem, &rogue_ca.key_pem, "node-a", validity)
                    .expect("rogue node cert");
            let (edge, node) = deployment
                .handshake(&deployment.client_tls_presenting(&rogue_node))
                .await;
            assert_edge_refused(edge, alert);
            assert_node_sees_refusal(node, alert).await;
        }
    })
    .await;
}

#[tokio::test]
async fn missing_client_certificate_is_rejected() {
    within_timeout(async {
        let deployment = Deployment::start(&[]);
        let mut roots = rustls::RootCertStore::empty();
        for ca in load_ca(&deployment.pki.ca_cert).expect("ca") {
            roots.add(ca).expect("ca root");
        }
        let mut tls = rustls::ClientConfig::builder_with_provider(crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("tls13")
            .with_root_certificates(roots)
            .with_no_client_auth();
        tls.alpn_protocols = vec![iop_wire::ALPN.to_vec()];
        let crypto =
            quinn::crypto::rustls::QuicClientConfig::try_from(tls).expect("quic client config");
        let mut node = quinn::Endpoint::client(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
            .expect("node endpoint");
        node.set_default_client_config(quinn::ClientConfig::new(Arc::new(crypto)));

        let (edge, node) = deployment.handshake_from(&node).await;
        assert_edge_refused(edge, AlertDescription::CertificateRequired);
        assert_node_sees_refusal(node, AlertDescription::CertificateRequired).await;
    })
    .await;
}

#[tokio::test]
async fn expired_client_certificate_is_rejected() {
    within_timeout(async {
        let deployment = Deployment::start(&[]);
        let expired = issue_node_cert(
            &deployment.ca_cert_pem,
            &deployment.ca_key_pem,
            "node-old",
            Validity::expired(Duration::from_secs(24 * 3600)),
        )
        .expect("expired cert");

        let (edge, node) = deployment
            .handshake(&deployment.client_tls_presenting(&expired))
            .await;
        assert_edge_refused(edge, AlertDescription::CertificateExpired);
        assert_node_sees_refusal(node, AlertDescription::CertificateExpired).await;
    })
    .await;
}

#[tokio::test]
async fn edge_server_certificate_cannot_act_as_a_node() {
    within_timeout(async {
        let deployment = Deployment::start(&[]);
        let tls = ClientTls::from_files(
            &deployment.pki.edge_cert,
            &deployment.pki.edge_key,
            &deployment.pki.ca_cert,
        )
        .expect("edge files as client tls");

        let (edge, node) = deployment.handshake(&tls).await;
        // Server-auth-only EKU: refused for client auth.
        assert_edge_refused(edge, AlertDescription::UnsupportedCertificate);
        assert_node_sees_refusal(node, AlertDescription::UnsupportedCertificate).await;
    })
    .await;
}

#[tokio::test]
async fn certificate_without_node_identity_is_refused() {
    within_timeout(async {
        let deployment = Deployment::start(&[]);
        let anonymous = issue_client_cert_without_node_identity(
            &deployment.ca_cert_pem,
            &deployment.ca_key_pem,
            "node-a",
            Validity::from_now(Duration::from_secs(3600)),
        )
        .expect("anonymous cert");

        let (edge, node) = deployment
            .handshake(&deployment.client_tls_presenting(&anonymous))
            .await;
        // The chain is valid, so the handshake succeeds...
        let edge_conn = edge.expect("chained certificate passes TLS");
        let node_conn = node.expect("node connects");
        // ...but a CN is not an identity: no node://<id>, no node.
        assert_eq!(peer_node_id(&edge_conn), Err(IdentityError::NoNodeIdentity));
        close_connection(&edge_conn, CloseCode::Unauthorized);

        let error = first_stream_io_error(&node_conn).await;
        assert!(
            matches!(
                error,
                FramedError::ConnectionLost {
                    close_code: Some(CloseCode::Unauthorized),
                    ..
                }
            ),
            "{error}"
        );
        assert_eq!(
            close_code_of(&node_conn.closed().await),
            Some(CloseCode::Unauthorized)
        );
    })
    .await;
}

#[tokio::test]
async fn framed_messages_round_trip_over_a_stream() {
    within_timeout(async {
        let deployment = Deployment::start(&["node-a"]);
        let (edge_conn, node_conn) = deployment.connected("node-a").await;
        // A register of ~140 KB spans several 64 KiB reads; the frames
        // after the first go in one batch (`send_all`), which writes past
        // `BATCH_WRITE_BYTES` and then the rest together.
        let sent = vec![
            NodeControl::Ping(Heartbeat { seq: 1 }),
            NodeControl::Register(register_request(4_000)),
            NodeControl::ConfigApplied { generation: 7 },
            NodeControl::Pong(Heartbeat { seq: 2 }),
            NodeControl::Closing {
                code: CloseCode::Shutdown,
            },
        ];

        let (mut node_send, mut node_recv) = open_framed(&node_conn).await.expect("open");
        let sender = async {
            node_send.send(&sent[0]).await.expect("send");
            node_send.send_all(&sent[1..]).await.expect("send_all");
            node_send.finish().expect("finish");
            node_send.stopped().await.expect("every frame delivered");
        };
        let receiver = async {
            let (mut edge_send, mut edge_recv) = accept_framed(&edge_conn).await.expect("accept");
            let mut received = Vec::new();
            while let Some(message) = edge_recv.recv::<NodeControl>().await.expect("recv") {
                received.push(message);
            }
            // The clean end stays a clean end.
            assert!(matches!(edge_recv.recv::<NodeControl>().await, Ok(None)));
            edge_send
                .send(&EdgeControl::Closing {
                    code: CloseCode::Normal,
                })
                .await
                .expect("answer");
            edge_send.finish().expect("finish");
            received
        };
        let ((), received) = tokio::join!(sender, receiver);
        assert_eq!(received, sent);

        assert_eq!(
            node_recv.recv::<EdgeControl>().await.expect("answer"),
            Some(EdgeControl::Closing {
                code: CloseCode::Normal
            })
        );
        assert!(matches!(node_recv.recv::<EdgeControl>().await, Ok(None)));
    })
    .await;
}

/// Every `[quic]` alternative (ACK frequency, no segmentation offload,
/// each congestion controller, a larger initial window) on both sides
/// still connects with mutual TLS and carries a ~140 KB message (more
/// than the default initial window) and its answer.
#[tokio::test]
async fn each_quic_tuning_connects_and_carries_a_large_message_both_ways() {
    use iop_transport::{AckFrequency, Congestion};
    let variants = [
        QuicTuning {
            ack_frequency: Some(AckFrequency {
                eliciting_threshold: 0,
                max_ack_delay: Some(Duration::from_millis(1)),
            }),
            ..QuicTuning::default()
        },
        QuicTuning {
            ack_frequency: Some(AckFrequency {
                eliciting_threshold: 10,
                max_ack_delay: None,
            }),
            segmentation_offload: false,
            congestion: Congestion::NewReno,
            ..QuicTuning::default()
        },
        QuicTuning {
            congestion: Congestion::Bbr,
            initial_window: Some(1_000_000),
            ..QuicTuning::default()
        },
    ];
    within_timeout(async {
        for tuning in variants {
            let deployment = Deployment::start_tuned(&["node-a"], CertDenylist::default(), &tuning);
            let node = client_endpoint(&deployment.node_tls("node-a"), &tuning).expect("node");
            let (edge_conn, node_conn) = deployment.handshake_from(&node).await;
            let (edge_conn, node_conn) = (edge_conn.expect("edge"), node_conn.expect("node"));
            let register = NodeControl::Register(register_request(4_000));
            let (mut node_send, mut node_recv) = open_framed(&node_conn).await.expect("open");
            let sender = async {
                node_send.send(&register).await.expect("send");
                node_send.finish().expect("finish");
            };
            let receiver = async {
                let (mut edge_send, mut edge_recv) =
                    accept_framed(&edge_conn).await.expect("accept");
                let got = edge_recv.recv::<NodeControl>().await.expect("recv");
                edge_send
                    .send(&EdgeControl::Closing {
                        code: CloseCode::Normal,
                    })
                    .await
                    .expect("answer");
                edge_send.finish().expect("finish");
                got
            };
            let ((), got) = tokio::join!(sender, receiver);
            assert_eq!(got.as_ref(), Some(&register), "{tuning:?}");
            assert_eq!(
                node_recv.recv::<EdgeControl>().await.expect("answer"),
                Some(EdgeControl::Closing {
                    code: CloseCode::Normal
                }),
                "{tuning:?}"
            );
        }
    })
    .await;
}

/// Open a stream and write raw bytes onto it (no framing).
async fn open_raw(conn: &quinn::Connection, bytes: &[u8]) -> FramedSend {
    let (send, _recv) = open_framed(conn).await.expect("open");
    let mut send = send;
    send.get_mut().write_all(bytes).await.expect("raw write");
    send
}

/// Accept the next stream with a small frame maximum.
async fn accept_with_max(conn: &quinn::Connection, max_frame_len: usize) -> FramedRecv {
    let (_send, recv) = conn.accept_bi().await.expect("accept");
    FramedRecv::with_max_frame_len(recv, max_frame_len)
}

#[tokio::test]
async fn oversize_frame_closes_that_stream_with_frame_too_large_and_other_streams_continue() {
    within_timeout(async {
        const MAX: usize = 1024;
        let deployment = Deployment::start(&["node-a"]);
        let (edge_conn, node_conn) = deployment.connected("node-a").await;

        // A length prefix one byte above the maximum, then some payload.
        let mut raw = u32::try_from(MAX + 1)
            .expect("small")
            .to_be_bytes()
            .to_vec();
        raw.extend_from_slice(&[0u8; 64]);
        let mut oversize = open_raw(&node_conn, &raw).await;

        let mut edge_recv = accept_with_max(&edge_conn, MAX).await;
        match edge_recv.recv::<NodeControl>().await {
            Err(FramedError::PeerProtocol {
                error: WireError::FrameTooLarge { len, max },
                code: StreamErrorCode::FrameTooLarge,
            }) => assert_eq!((len, max), (MAX as u64 + 1, MAX)),
            other => panic!("expected FrameTooLarge, got {other:?}"),
        }
        // The stream stays broken with the same typed error.
        assert!(matches!(
            edge_recv.recv::<NodeControl>().await,
            Err(FramedError::PeerProtocol {
                code: StreamErrorCode::FrameTooLarge,
                ..
            })
        ));
        // The sender observes STOP with FrameTooLarge.
        match oversize.stopped().await {
            Err(FramedError::StoppedByPeer {
                code: Some(StreamErrorCode::FrameTooLarge),
                raw_code,
            }) => assert_eq!(raw_code, u64::from(StreamErrorCode::FrameTooLarge.code())),
            other => panic!("expected a stop with FrameTooLarge, got {other:?}"),
        }

        // Another stream on the same connection still works, both ways.
        let (mut node_send, mut node_recv) = open_framed(&node_conn).await.expect("open");
        node_send
            .send(&NodeControl::Ping(Heartbeat { seq: 3 }))
            .await
            .expect("send");
        let (mut edge_send, mut edge_recv) = accept_framed(&edge_conn).await.expect("accept");
        assert_eq!(
            edge_recv.recv::<NodeControl>().await.expect("recv"),
            Some(NodeControl::Ping(Heartbeat { seq: 3 }))
        );
        edge_send
            .send(&EdgeControl::Pong(Heartbeat { seq: 3 }))
            .await
            .expect("send");
        assert_eq!(
            node_recv.recv::<EdgeControl>().await.expect("recv"),
            Some(EdgeControl::Pong(Heartbeat { seq: 3 }))
        );
        assert!(edge_conn.close_reason().is_none());
        assert!(node_conn.close_reason().is_none());
    })
    .await;
}

#[tokio::test]
async fn garbage_frame_is_a_typed_malformed_error() {
    within_timeout(async {
        let deployment = Deployment::start(&["node-a"]);
        let (edge_conn, node_conn) = deployment.connected("node-a").await;

        // A well-sized frame whose payload is no NodeControl: an unfinished
        // varint variant index.
        let mut raw = 4u32.to_be_bytes().to_vec();
        raw.extend_from_slice(&[0xff; 4]);
        let mut garbage = open_raw(&node_conn, &raw).await;

        let mut edge_recv = accept_with_max(&edge_conn, 1024).await;
        match edge_recv.recv::<NodeControl>().await {
            Err(
                error @ FramedError::PeerProtocol {
                    error: WireError::Malformed(_),
                    code: StreamErrorCode::Malformed,
                },
            ) => assert!(error.is_peer_fault()),
            other => panic!("expected Malformed, got {other:?}"),
        }
        assert!(matches!(
            garbage.stopped().await,
            Err(FramedError::StoppedByPeer {
                code: Some(StreamErrorCode::Malformed),
                ..
            })
        ));
        assert!(edge_conn.close_reason().is_none());
    })
    .await;
}

#[tokio::test]
async fn stream_ending_inside_a_frame_is_a_typed_truncated_error() {
    within_timeout(async {
        let deployment = Deployment::start(&["node-a"]);
        let (edge_conn, node_conn) = deployment.connected("node-a").await;

        // Announces 10 bytes, sends 3, then finishes.
        let mut raw = 10u32.to_be_bytes().to_vec();
        raw.extend_from_slice(&[1, 2, 3]);
        let mut truncated = open_raw(&node_conn, &raw).await;
        truncated.finish().expect("finish");

        let mut edge_recv = accept_with_max(&edge_conn, 1024).await;
        assert!(matches!(
            edge_recv.recv::<NodeControl>().await,
            Err(FramedError::PeerProtocol {
                error: WireError::Truncated { buffered: 7 },
                code: StreamErrorCode::Truncated,
            })
        ));
    })
    .await;
}

#[tokio::test]
async fn stream_reset_by_peer_carries_its_code() {
    within_timeout(async {
        let deployment = Deployment::start(&["node-a"]);
        let (edge_conn, node_conn) = deployment.connected("node-a").await;

        let (mut edge_send, _edge_recv) = open_framed(&edge_conn).await.expect("open");
        edge_send
            .send(&EdgeControl::Ping(Heartbeat { seq: 1 }))
            .await
            .expect("send");
        let (_node_send, mut node_recv) = accept_framed(&node_conn).await.expect("accept");
        assert_eq!(
            node_recv.recv::<EdgeControl>().await.expect("first frame"),
            Some(EdgeControl::Ping(Heartbeat { seq: 1 }))
        );
        edge_send.reset(StreamErrorCode::Canceled).expect("reset");
        match node_recv.recv::<EdgeControl>().await {
            Err(FramedError::ResetByPeer {
                code: Some(StreamErrorCode::Canceled),
                raw_code,
            }) => assert_eq!(raw_code, u64::from(StreamErrorCode::Canceled.code())),
            other => panic!("expected a reset with Canceled, got {other:?}"),
        }
    })
    .await;
}

#[tokio::test]
async fn send_refuses_a_frame_above_its_maximum_before_writing() {
    within_timeout(async {
        let deployment = Deployment::start(&["node-a"]);
        let (_edge_conn, node_conn) = deployment.connected("node-a").await;
        let (send, _recv) = node_conn.open_bi().await.expect("open");
        let mut send = FramedSend::with_max_frame_len(send, 1024);
        match send
            .send(&NodeControl::Register(register_request(1_000)))
            .await
        {
            Err(error @ FramedError::Encode(WireError::FrameTooLarge { max: 1024, .. })) => {
                assert!(!error.is_peer_fault())
            }
            other => panic!("expected a local FrameTooLarge, got {other:?}"),
        }
        // Nothing was written: a small message still frames cleanly.
        send.send(&NodeControl::Ping(Heartbeat { seq: 1 }))
            .await
            .expect("small frame");
        // In a batch too: the large frame and everything after it are
        // never written.
        let batch = [
            NodeControl::Ping(Heartbeat { seq: 2 }),
            NodeControl::Register(register_request(1_000)),
            NodeControl::Ping(Heartbeat { seq: 3 }),
        ];
        assert!(matches!(
            send.send_all(&batch).await,
            Err(FramedError::Encode(WireError::FrameTooLarge {
                max: 1024,
                ..
            }))
        ));
        send.send_all(&batch[..1]).await.expect("small batch");
    })
    .await;
}

#[tokio::test]
async fn frames_are_limited_per_direction_node_to_edge_much_smaller() {
    // R-LIM-3: a node's frames are bounded far below an edge request's.
    within_timeout(async {
        let deployment = Deployment::start(&["node-a"]);
        let (edge_conn, node_conn) = deployment.connected("node-a").await;
        let big = iop_wire::NODE_FRAME_MAX_LEN + 1;

        // The Edge sends a request larger than any node frame: it arrives.
        let (mut edge_send, _edge_recv) = open_framed(&edge_conn).await.expect("open");
        let request = iop_wire::ProviderTunnelFrame::Body(vec![7; big]);
        let receive = async {
            let (_node_send, mut node_recv) = accept_framed(&node_conn).await.expect("accept");
            node_recv
                .recv::<iop_wire::ProviderTunnelFrame>()
                .await
                .expect("recv")
        };
        let (sent, received) = tokio::join!(edge_send.send(&request), receive);
        sent.expect("an edge frame may be large");
        assert_eq!(received, Some(request));

        // The node refuses to send one that large ...
        let (mut node_send, _node_recv) = open_framed(&node_conn).await.expect("open");
        let oversize = iop_wire::ProviderTunnelFrame::Body(vec![7; big]);
        assert!(matches!(
            node_send.send(&oversize).await,
            Err(FramedError::Encode(WireError::FrameTooLarge { .. }))
        ));
        node_send.finish().expect("finish");
        let (_s, mut empty) = accept_framed(&edge_conn).await.expect("accept");
        assert!(matches!(empty.recv::<NodeControl>().await, Ok(None)));
        // ... and the Edge stops a stream whose frame announces it.
        let mut raw = u32::try_from(big).expect("fits").to_be_bytes().to_vec();
        raw.extend_from_slice(&[0u8; 64]);
        let _raw = open_raw(&node_conn, &raw).await;
        let (_s, mut edge_recv) = accept_framed(&edge_conn).await.expect("accept");
        match edge_recv.recv::<NodeControl>().await {
            Err(FramedError::PeerProtocol {
                error: WireError::FrameTooLarge { max, .. },
                code: StreamErrorCode::FrameTooLarge,
            }) => assert_eq!(max, iop_wire::NODE_FRAME_MAX_LEN),
            other => panic!("expected FrameTooLarge, got {other:?}"),
        }
    })
    .await;
}

#[tokio::test]
async fn a_node_certificate_on_the_denylist_is_refused_until_removed() {
    // Revocation of one node's certificate, reloadable without a restart.
    within_timeout(async {
        let denylist = CertDenylist::default();
        let deployment = Deployment::start_with_denylist(&["node-a", "node-b"], denylist.clone());
        let revoked = deployment.node_tls("node-a");
        let fingerprint = iop_transport::cert_fingerprint(&revoked.cert_chain[0]);
        denylist.replace([fingerprint]);
        let (edge, node) = deployment.handshake(&revoked).await;
        assert_edge_refused(edge, AlertDescription::CertificateRevoked);
        assert_node_sees_refusal(node, AlertDescription::CertificateRevoked).await;
        // Another node of the same CA is unaffected.
        let (edge, _node) = deployment.handshake(&deployment.node_tls("node-b")).await;
        edge.expect("node-b accepted");
        // Taken off the list (a reload), node-a gets in again.
        denylist.replace([]);
        let (edge, _node) = deployment.handshake(&revoked).await;
        edge.expect("node-a accepted again");
    })
    .await;
}

#[test]
fn fingerprints_parse_from_hex_with_or_without_colons() {
    let hex = "00112233445566778899aabbccddeeff00112233445566778899AABBCCDDEEFF";
    let parsed = iop_transport::parse_fingerprint(hex).expect("hex");
    assert_eq!(parsed[1], 0x11);
    assert_eq!(parsed[31], 0xff);
    let colons: Vec<String> = hex
        .as_bytes()
        .chunks(2)
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .collect();
    assert_eq!(
        iop_transport::parse_fingerprint(&colons.join(":")),
        Some(parsed)
    );
    assert_eq!(iop_transport::parse_fingerprint("abc"), None);
    assert_eq!(iop_transport::parse_fingerprint(&"zz".repeat(32)), None);
}

#[tokio::test]
async fn a_connection_open_when_its_certificate_is_revoked_is_closed_unauthorized() {
    within_timeout(async {
        let denylist = CertDenylist::default();
        let deployment = Deployment::start_with_denylist(&["node-a"], denylist.clone());
        let (edge_conn, node_conn) = deployment.connected("node-a").await;
        let enforcing = tokio::spawn(iop_transport::enforce_denylist(
            edge_conn.clone(),
            denylist.clone(),
        ));
        // An unrelated entry changes nothing.
        denylist.replace([[9u8; 32]]);
        tokio::task::yield_now().await;
        assert!(edge_conn.close_reason().is_none());
        let leaf = deployment.node_tls("node-a").cert_chain[0].clone();
        denylist.replace([iop_transport::cert_fingerprint(&leaf)]);
        let closed = node_conn.closed().await;
        assert_eq!(
            close_code_of(&closed),
            Some(CloseCode::Unauthorized),
            "{closed}"
        );
        enforcing
            .await
            .expect("the enforcer ends with the connection");
    })
    .await;
}
