//! A hostile node: enrolled (it holds a valid certificate for node id
//! `evil`), it speaks the wire protocol through `iop-transport` and then
//! abuses it: floods stale `Ready` frames, floods parked-run reports, or
//! answers every tunnel with a maximal head.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context as _, bail};
use iop_transport::framed::{FramedRecv, FramedSend, accept_framed, open_framed};
use iop_transport::{ClientTls, QuicTuning, client_endpoint, connect};
use iop_wire::{
    AdapterKind, CapabilitiesReport, CommandKind, CommandResult, CommandResultBody, DataRequest,
    EdgeControl, Heartbeat, MAX_HEADER_BYTES, MAX_HEADERS, MAX_PARKED_RUNS, NodeControl,
    NodeReadyRequest, OfferedProvider, ParkedRun, ProviderHealth, ProviderTunnelFrame,
    RegisterRequest, RegisterResponse, RunKey, TargetHealth,
};
use tokio::sync::mpsc;

use crate::AttackStats;

/// A registered, ready hostile node.
pub(crate) struct EvilNode {
    _endpoint: quinn::Endpoint,
    conn: quinn::Connection,
    send: FramedSend,
    recv: FramedRecv,
    generation: u64,
}

impl EvilNode {
    /// Connect as `evil`, register and report ready.
    pub(crate) async fn connect(dir: &Path, edge: SocketAddr) -> anyhow::Result<Self> {
        let certs = dir.join("certs");
        let tls = ClientTls::from_files(
            &certs.join("node-evil.pem"),
            &certs.join("node-evil.key"),
            &certs.join("ca.pem"),
        )?;
        let endpoint = client_endpoint(&tls, &QuicTuning::default())?;
        let conn = connect(&endpoint, edge, "localhost").await?;
        let (mut send, mut recv) = open_framed(&conn).await?;
        send.send(&NodeControl::Register(RegisterRequest {
            protocol_version: iop_wire::PROTOCOL_VERSION,
            node_version: "attack".into(),
            providers: vec![OfferedProvider {
                adapter: AdapterKind::OpenAi,
                target: "t".into(),
                models: Vec::new(),
                max_concurrent_runs: None,
            }],
            max_concurrent_runs: 256,
            recipient_public_key: None,
            parked: Vec::new(),
        }))
        .await?;
        let generation = loop {
            match recv
                .recv::<EdgeControl>()
                .await?
                .context("control stream ended")?
            {
                EdgeControl::Registered(RegisterResponse::Accepted { generation, .. }) => {
                    break generation;
                }
                EdgeControl::Registered(RegisterResponse::Rejected { message, .. }) => {
                    bail!("the edge rejected the hostile node: {message}")
                }
                _ => {}
            }
        };
        send.send(&NodeControl::Ready(NodeReadyRequest { generation }))
            .await?;
        Ok(Self {
            _endpoint: endpoint,
            conn,
            send,
            recv,
            generation,
        })
    }

    /// Answer pings (so the connection stays up) and every data stream:
    /// capabilities as available, tunnels with `tunnel_answer`.
    fn serve_streams(
        conn: quinn::Connection,
        mut recv: FramedRecv,
        pongs: mpsc::UnboundedSender<u64>,
        stop: Arc<AtomicBool>,
        stats: Arc<AttackStats>,
        tunnel_answer: Option<Arc<Vec<ProviderTunnelFrame>>>,
    ) {
        tokio::spawn(async move {
            while let Ok(Some(msg)) = recv.recv::<EdgeControl>().await {
                if let EdgeControl::Ping(Heartbeat { seq }) = msg {
                    let _ = pongs.send(seq);
                }
            }
        });
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let Ok((mut send, mut recv)) = accept_framed(&conn).await else {
                    return;
                };
                let answer = tunnel_answer.clone();
                let stats = stats.clone();
                tokio::spawn(async move {
                    match recv.recv::<DataRequest>().await {
                        Ok(Some(DataRequest::Command(cmd))) => {
                            if let CommandKind::Capabilities { .. } = cmd.kind {
                                let _ = send
                                    .send(&CommandResult {
                                        command_id: cmd.command_id,
                                        session_id: cmd.session_id,
                                        body: CommandResultBody::Capabilities(CapabilitiesReport {
                                            targets: vec![TargetHealth {
                                                adapter: AdapterKind::OpenAi,
                                                target: "t".into(),
                                                status: ProviderHealth::Available,
                                                failure_code: None,
                                                models: Vec::new(),
                                            }],
                                            health_observation_seq: 1,
                                        }),
                                    })
                                    .await;
                                let _ = send.finish();
                            }
                        }
                        Ok(Some(DataRequest::Tunnel(_))) => {
                            if let Some(frames) = answer {
                                stats.count("maximal heads sent");
                                for frame in frames.iter() {
                                    if send.send(frame).await.is_err() {
                                        stats.count("head refused by edge");
                                        return;
                                    }
                                }
                                let _ = send.finish();
                            }
                        }
                        _ => {}
                    }
                });
            }
        });
    }

    /// Send `Ready` frames of an older generation as fast as the stream
    /// takes them, until `stop`.
    pub(crate) async fn flood_stale_ready(self, stop: Arc<AtomicBool>, stats: Arc<AttackStats>) {
        let (pong_tx, mut pong_rx) = mpsc::unbounded_channel();
        Self::serve_streams(
            self.conn.clone(),
            self.recv,
            pong_tx,
            stop.clone(),
            stats.clone(),
            None,
        );
        let mut send = self.send;
        let stale = NodeControl::Ready(NodeReadyRequest {
            generation: self.generation.saturating_sub(1),
        });
        let mut sent = 0u64;
        while !stop.load(Ordering::Relaxed) {
            while let Ok(seq) = pong_rx.try_recv() {
                let _ = send.send(&NodeControl::Pong(Heartbeat { seq })).await;
            }
            if send.send(&stale).await.is_err() {
                stats.count("disconnected by edge");
                break;
            }
            sent += 1;
            if sent.is_multiple_of(1024) {
                tokio::task::yield_now().await;
            }
        }
        for _ in 0..sent {
            stats.count("stale Ready frames");
        }
        self.conn.close(0u32.into(), b"attack over");
    }

    /// Answer every tunnel with a head of [`MAX_HEADERS`] headers of
    /// [`MAX_HEADER_BYTES`] each (the most the wire allows), a body and
    /// the end, until `stop`.
    pub(crate) async fn answer_with_maximal_heads(
        self,
        stop: Arc<AtomicBool>,
        stats: Arc<AttackStats>,
    ) {
        let headers = (0..MAX_HEADERS)
            .map(|i| {
                let name = format!("x-evil-{i:04}");
                let value = "v".repeat(MAX_HEADER_BYTES - name.len());
                (name, value)
            })
            .collect();
        let frames = Arc::new(vec![
            ProviderTunnelFrame::Head {
                status: 200,
                headers,
            },
            ProviderTunnelFrame::Body(b"{}".to_vec()),
            ProviderTunnelFrame::End,
        ]);
        let (pong_tx, mut pong_rx) = mpsc::unbounded_channel();
        Self::serve_streams(
            self.conn.clone(),
            self.recv,
            pong_tx,
            stop.clone(),
            stats,
            Some(frames),
        );
        let mut send = self.send;
        while !stop.load(Ordering::Relaxed) {
            tokio::select! {
                Some(seq) = pong_rx.recv() => {
                    let _ = send.send(&NodeControl::Pong(Heartbeat { seq })).await;
                }
                () = tokio::time::sleep(std::time::Duration::from_millis(200)) => {}
            }
        }
        self.conn.close(0u32.into(), b"attack over");
    }

    /// Flood parked-run reports (R-PARK-2, R-LIM-4), each the most the
    /// wire allows: half of it one run key again and again, half distinct
    /// runs naming well-formed response ids no Edge issued, as fast as the
    /// stream takes them; when the Edge closes the connection, connect
    /// again and go on, until `stop`. A violation: one connection that
    /// carried more than twice the Edge's report budget and was still open
    /// [`FLOOD_GRACE`] later.
    pub(crate) async fn flood_parked_reports(
        dir: std::path::PathBuf,
        edge: SocketAddr,
        stop: Arc<AtomicBool>,
        stats: Arc<AttackStats>,
    ) {
        let mut seed = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let node = match Self::connect(&dir, edge).await {
                Ok(node) => node,
                Err(_) => {
                    stats.count("connections refused");
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                    continue;
                }
            };
            stats.count("connections");
            let (pong_tx, mut pong_rx) = mpsc::unbounded_channel();
            Self::serve_streams(
                node.conn.clone(),
                node.recv,
                pong_tx,
                stop.clone(),
                stats.clone(),
                None,
            );
            let mut send = node.send;
            let generation = node.generation;
            let opened = tokio::time::Instant::now();
            let mut sent = 0u64;
            while !stop.load(Ordering::Relaxed) {
                while let Ok(seq) = pong_rx.try_recv() {
                    let _ = send.send(&NodeControl::Pong(Heartbeat { seq })).await;
                }
                seed += 1;
                let runs = parked_report(generation, seed);
                if send.send(&NodeControl::Parked { runs }).await.is_err()
                    || node.conn.close_reason().is_some()
                {
                    stats.count("disconnected by edge");
                    break;
                }
                sent += 1;
                stats.count("reports sent");
                if sent > 2 * u64::from(iop_core::edge::flood::PARKED_REPORTS_PER_WINDOW)
                    && opened.elapsed() > FLOOD_GRACE
                {
                    stats.violate(format!(
                        "a connection carried {sent} parked-run reports in {:.0?} and is still open",
                        opened.elapsed()
                    ));
                    break;
                }
                tokio::task::yield_now().await;
            }
            node.conn.close(0u32.into(), b"attack over");
        }
    }
}

/// How long a flooding connection may stay open past the Edge's budget
/// (its window is 10 s).
const FLOOD_GRACE: std::time::Duration = std::time::Duration::from_secs(12);

/// One parked-run report of [`MAX_PARKED_RUNS`] runs: half one run key
/// repeated, half distinct runs of `resp_<16 hex>` ids.
fn parked_report(generation: u64, seed: u64) -> Vec<ParkedRun> {
    (0..MAX_PARKED_RUNS as u64)
        .map(|i| {
            let distinct = i % 2 == 1;
            let run_id = if distinct { seed * 1_000_000 + i } else { 1 };
            ParkedRun {
                key: RunKey { generation, run_id },
                response_id: format!("resp_{:016x}", if distinct { run_id } else { 1 }),
                adapter: AdapterKind::OpenAi,
                target: "t".into(),
                first_kept_frame: 0,
                last_frame: 1,
                ended: false,
            }
        })
        .collect()
}
