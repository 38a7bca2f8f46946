//! One task per node connection: identity, registration, readiness, then
//! heartbeats on the control stream until the connection ends.
//!
//! The task owns the connection's heartbeat machine and runs one `select!`
//! over control frames, the heartbeat's next timeout and commands from the
//! hub, draining the machine's outputs into frames after every input.

use std::time::Duration;

use iop_core::edge::flood::{Flood, FrameBudget};
use iop_core::ids::{Generation, NodeId};
use iop_core::liveness::heartbeat::{Heartbeat, HeartbeatConfig, HeartbeatInput, HeartbeatOutput};
use iop_transport::framed::{FramedError, FramedRecv, FramedSend, accept_framed};
use iop_transport::{close_code_of, close_connection, peer_node_id};
use iop_wire::{
    CloseCode, EdgeControl, NodeControl, NodeReadyResponse, PROTOCOL_VERSION, RegisterResponse,
};
use tokio::sync::mpsc;

use crate::hub::{HubHandle, LinkCommand, LinkHandle};
use iop_transport::clock::Clock;

/// How long a new connection may take to open its control stream, register
/// and report ready.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The most frames attributed to another (stale) generation one connection
/// may send (core's rule, `iop_core::edge::flood`).
pub use iop_core::edge::flood::MAX_STALE_FRAMES_PER_CONNECTION;

/// A connection past one of its budgets (R-LIM-4) is closed with
/// `protocol_error`.
fn flooded(node: &NodeId, result: Result<(), Flood>) -> Result<(), CloseCode> {
    result.map_err(|flood| {
        tracing::warn!(event = "edge_node_frame_flood", node = %node, flood = flood.as_str());
        CloseCode::ProtocolError
    })
}

/// Settings of every link.
#[derive(Debug, Clone)]
pub struct LinkSettings {
    /// Heartbeat profile (R-HB-1).
    pub heartbeat: HeartbeatConfig,
    /// Node certificates revoked while their connection is open end it
    /// (re-read on SIGHUP).
    pub denylist: iop_transport::CertDenylist,
}

/// Serve one incoming connection until it ends.
pub async fn serve(
    incoming: quinn::Incoming,
    hub: HubHandle,
    clock: Clock,
    settings: LinkSettings,
) {
    let conn = match incoming.await {
        Ok(conn) => conn,
        Err(e) => {
            // mTLS refusals (wrong CA, no certificate, expired) land here.
            tracing::warn!(event = "edge_handshake_refused", error = %e);
            return;
        }
    };
    let node = match peer_node_id(&conn) {
        Ok(id) => NodeId::new(id),
        Err(e) => {
            tracing::warn!(event = "edge_identity_refused", error = %e);
            close_connection(&conn, CloseCode::Unauthorized);
            return;
        }
    };
    // A certificate revoked while this connection is open ends it.
    tokio::spawn(iop_transport::enforce_denylist(
        conn.clone(),
        settings.denylist.clone(),
    ));
    let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
    let link = LinkHandle {
        conn: conn.clone(),
        commands: cmd_tx,
    };
    // Set as soon as the hub accepted the registration: from then on every
    // way out reports the generation's end, so it is fenced (R-GEN-3).
    let mut registered = None;
    let handshake = tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        handshake(&conn, &node, &hub, link, &mut registered),
    );
    let (generation, send, recv) = match handshake.await {
        Ok(Ok(Some(done))) => done,
        Ok(Ok(None)) => return,
        Ok(Err(e)) => {
            tracing::warn!(event = "edge_handshake_failed", node = %node, error = %e);
            let code = protocol_close_code(&e);
            close_connection(&conn, code);
            if let Some(generation) = registered {
                hub.link_closed(node, generation, code);
            }
            return;
        }
        Err(_) => {
            tracing::warn!(event = "edge_handshake_timeout", node = %node);
            close_connection(&conn, CloseCode::ProtocolError);
            if let Some(generation) = registered {
                hub.link_closed(node, generation, CloseCode::ProtocolError);
            }
            return;
        }
    };
    tracing::info!(event = "edge_node_connected", node = %node, generation);
    let reason = control_loop(
        &conn, &node, generation, send, recv, cmd_rx, &hub, clock, settings,
    )
    .await;
    close_connection(&conn, reason);
    tracing::info!(
        event = "edge_node_disconnected",
        node = %node,
        generation,
        reason = reason.as_str()
    );
    hub.link_closed(node, generation, reason);
}

fn protocol_close_code(e: &FramedError) -> CloseCode {
    match e {
        FramedError::ConnectionLost { close_code, .. } => close_code.unwrap_or(CloseCode::Normal),
        _ => CloseCode::ProtocolError,
    }
}

/// Register and ready. `Ok(None)` when the registration was refused or
/// superseded (the connection is already closed and any generation
/// reported closed). Once the hub accepts the registration its generation is
/// stored in `registered`, so the caller can report its end whatever
/// happens next.
async fn handshake(
    conn: &quinn::Connection,
    node: &NodeId,
    hub: &HubHandle,
    link: LinkHandle,
    registered: &mut Option<Generation>,
) -> Result<Option<(Generation, FramedSend, FramedRecv)>, FramedError> {
    let (mut send, mut recv) = accept_framed(conn).await?;
    let Some(NodeControl::Register(request)) = recv.recv::<NodeControl>().await? else {
        return Err(FramedError::LocalMisuse {
            what: "the first control frame must be Register",
        });
    };
    let Ok(answer) = hub.register(node.clone(), request, link).await else {
        close_connection(conn, CloseCode::Shutdown);
        return Ok(None);
    };
    let generation = match answer {
        Ok((generation, config)) => {
            *registered = Some(generation);
            send.send(&EdgeControl::Registered(RegisterResponse::Accepted {
                generation,
                config,
            }))
            .await?;
            generation
        }
        Err(rejection) => {
            tracing::warn!(
                event = "edge_registration_rejected",
                node = %node,
                reason = rejection.reason.as_str(),
                cause = rejection.cause.as_str(),
                detail = %rejection.message
            );
            send.send(&EdgeControl::Registered(RegisterResponse::Rejected {
                reason: rejection.reason,
                message: rejection.message,
                edge_protocol_version: PROTOCOL_VERSION,
            }))
            .await?;
            let _ = send.finish();
            // Let the frame reach the node before the close does.
            let _ = tokio::time::timeout(Duration::from_secs(1), send.stopped()).await;
            close_connection(conn, CloseCode::RegistrationRejected);
            return Ok(None);
        }
    };
    let mut budget = FrameBudget::new(iop_core::time::Instant::ZERO);
    loop {
        match recv.recv::<NodeControl>().await? {
            Some(NodeControl::Ready(ready)) if ready.generation == generation => {
                let accepted = hub.ready(node.clone(), generation).await.unwrap_or(false);
                send.send(&EdgeControl::ReadyAck(NodeReadyResponse {
                    generation,
                    accepted,
                }))
                .await?;
                if !accepted {
                    // Superseded while registering.
                    close_connection(conn, CloseCode::Superseded);
                    hub.link_closed(node.clone(), generation, CloseCode::Superseded);
                    return Ok(None);
                }
                return Ok(Some((generation, send, recv)));
            }
            Some(NodeControl::Ready(late)) => {
                if let Err(code) = flooded(node, budget.stale_frame()) {
                    close_connection(conn, code);
                    hub.link_closed(node.clone(), generation, code);
                    return Ok(None);
                }
                hub.late_message(node.clone(), late.generation);
            }
            Some(NodeControl::Ping(hb)) => {
                send.send(&EdgeControl::Pong(hb)).await?;
            }
            Some(_) => {}
            None => {
                return Err(FramedError::LocalMisuse {
                    what: "control stream ended before Ready",
                });
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn control_loop(
    conn: &quinn::Connection,
    node: &NodeId,
    generation: Generation,
    mut send: FramedSend,
    mut recv: FramedRecv,
    mut commands: mpsc::UnboundedReceiver<LinkCommand>,
    hub: &HubHandle,
    clock: Clock,
    settings: LinkSettings,
) -> CloseCode {
    let mut heartbeat = Heartbeat::new(clock.now(), settings.heartbeat);
    let mut budget = FrameBudget::new(clock.now());
    loop {
        let wake = heartbeat.poll_timeout();
        tokio::select! {
            frame = recv.recv::<NodeControl>() => match frame {
                Ok(Some(NodeControl::Ping(hb))) => heartbeat.handle_input(clock.now(), HeartbeatInput::Ping { seq: hb.seq }),
                Ok(Some(NodeControl::Pong(hb))) => heartbeat.handle_input(clock.now(), HeartbeatInput::Pong { seq: hb.seq }),
                Ok(Some(NodeControl::Closing { code })) => return code,
                Ok(Some(NodeControl::Ready(r))) if r.generation != generation => {
                    if let Err(code) = flooded(node, budget.stale_frame()) {
                        return code;
                    }
                    hub.late_message(node.clone(), r.generation);
                }
                Ok(Some(NodeControl::ConfigApplied { generation: g })) if g != generation => {
                    if let Err(code) = flooded(node, budget.stale_frame()) {
                        return code;
                    }
                    hub.late_message(node.clone(), g);
                }
                Ok(Some(NodeControl::Parked { runs })) => {
                    if let Err(code) = flooded(node, budget.parked_report(clock.now())) {
                        return code;
                    }
                    hub.parked(node.clone(), generation, runs);
                }
                Ok(Some(NodeControl::Register(_))) => return CloseCode::ProtocolError,
                Ok(Some(_)) => {}
                Ok(None) => return CloseCode::Normal,
                Err(FramedError::ConnectionLost { close_code, .. }) => {
                    return close_code.unwrap_or(CloseCode::Normal);
                }
                Err(e) => {
                    tracing::warn!(event = "edge_control_stream_error", node = %node, error = %e);
                    return CloseCode::ProtocolError;
                }
            },
            () = clock.sleep_until(wake) => heartbeat.handle_timeout(clock.now()),
            cmd = commands.recv() => match cmd {
                Some(LinkCommand::Close(code)) => return code,
                Some(LinkCommand::Cancel(run_id)) => {
                    if send.send(&EdgeControl::Cancel(iop_wire::Cancel { run_id })).await.is_err() {
                        return CloseCode::Normal;
                    }
                }
                Some(LinkCommand::Refresh(snapshot)) => {
                    if send.send(&EdgeControl::ConfigRefresh(*snapshot)).await.is_err() {
                        return CloseCode::Normal;
                    }
                }
                None => return CloseCode::Shutdown,
            },
            err = conn.closed() => return close_code_of(&err).unwrap_or(CloseCode::Normal),
        }
        while let Some(out) = heartbeat.poll_output() {
            let frame = match out {
                HeartbeatOutput::SendPing(seq) => EdgeControl::Ping(iop_wire::Heartbeat { seq }),
                HeartbeatOutput::SendPong(seq) => EdgeControl::Pong(iop_wire::Heartbeat { seq }),
                HeartbeatOutput::TimedOut => {
                    tracing::warn!(event = "edge_heartbeat_timeout", node = %node, generation);
                    return CloseCode::HeartbeatTimeout;
                }
            };
            if send.send(&frame).await.is_err() {
                return CloseCode::Normal;
            }
        }
    }
}
