//! One task per node connection. The connection's rules are the core
//! [`EdgeLink`]'s (identity aside: registration and readiness through the
//! dispatcher, the heartbeat, the node's frame budgets, reporting the
//! generation's end); this task runs one `select!` over control frames, the
//! machine's next timeout, commands from the hub and the connection's
//! close, feeds each as an input and carries out the outputs.

use std::time::Duration;

use iop_core::edge::link::{EdgeLinkConfig, EdgeLinkInput, EdgeLinkOutput};
use iop_core::edge::registry::Rejection;
use iop_core::ids::NodeId;
use iop_core::liveness::heartbeat::HeartbeatConfig;
use iop_trace::{DrivenEdgeLink, EdgeLinkConfigRec, MachineKind, TraceFiles};
use iop_transport::framed::{FramedError, FramedSend, accept_framed};
use iop_transport::{close_code_of, close_connection, peer_node_id};
use iop_wire::{CloseCode, NodeControl};
use tokio::sync::mpsc;

use crate::hub::{HubHandle, LinkCommand, LinkHandle};
use iop_transport::clock::Clock;

/// How long a new connection may take to open its control stream, register
/// and report ready.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The most frames attributed to another (stale) generation one connection
/// may send (core's rule, `iop_core::edge::flood`).
pub use iop_core::edge::flood::MAX_STALE_FRAMES_PER_CONNECTION;

/// Settings of every link.
#[derive(Debug, Clone)]
pub struct LinkSettings {
    /// Heartbeat profile (R-HB-1).
    pub heartbeat: HeartbeatConfig,
    /// Node certificates revoked while their connection is open end it
    /// (re-read on SIGHUP).
    pub denylist: iop_transport::CertDenylist,
    /// Which machines are recorded (`--trace-machine edge-link`).
    pub traces: std::sync::Arc<TraceFiles>,
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
    let started = clock.now();
    let (send, recv) = match tokio::time::timeout(HANDSHAKE_TIMEOUT, accept_framed(&conn)).await {
        Ok(Ok(pair)) => pair,
        Ok(Err(e)) => {
            tracing::warn!(event = "edge_handshake_failed", node = %node, error = %e);
            close_connection(&conn, protocol_close_code(&e));
            return;
        }
        Err(_) => {
            tracing::warn!(event = "edge_handshake_timeout", node = %node);
            close_connection(&conn, CloseCode::ProtocolError);
            return;
        }
    };
    let now = clock.now();
    let (commands_tx, commands) = mpsc::unbounded_channel();
    let config = EdgeLinkConfigRec {
        config: EdgeLinkConfig {
            heartbeat: settings.heartbeat,
            // The bound counts from the connection, the stream's
            // acceptance included.
            handshake_timeout: Some(HANDSHAKE_TIMEOUT.saturating_sub(now - started)),
        },
        created_us: now.as_micros(),
    };
    let tap = settings
        .traces
        .tap(MachineKind::EdgeLink, || config)
        .unwrap_or_else(|e| {
            tracing::error!(event = "edge_trace_open_failed", machine = "edge-link", error = %e);
            iop_trace::Tap::off()
        });
    let mut task = LinkTask {
        link: DrivenEdgeLink::new_edge_link(config, tap),
        handle: Some(LinkHandle {
            conn: conn.clone(),
            commands: commands_tx,
        }),
        conn,
        node,
        hub,
        clock,
        send,
        was_live: false,
    };
    task.run(recv, commands).await;
}

fn protocol_close_code(e: &FramedError) -> CloseCode {
    match e {
        FramedError::ConnectionLost { close_code, .. } => close_code.unwrap_or(CloseCode::Normal),
        _ => CloseCode::ProtocolError,
    }
}

struct LinkTask {
    link: DrivenEdgeLink,
    /// Handed to the hub with the registration.
    handle: Option<LinkHandle>,
    conn: quinn::Connection,
    node: NodeId,
    hub: HubHandle,
    clock: Clock,
    send: FramedSend,
    was_live: bool,
}

impl LinkTask {
    fn input(&mut self, input: EdgeLinkInput) {
        self.link.handle_input(self.clock.now(), input);
    }

    async fn run(
        &mut self,
        mut recv: iop_transport::framed::FramedRecv,
        mut commands: mpsc::UnboundedReceiver<LinkCommand>,
    ) {
        loop {
            let wake = self.link.poll_timeout();
            let live = self.link.machine().is_live();
            let conn = self.conn.clone();
            tokio::select! {
                frame = recv.recv::<NodeControl>() => match frame {
                    Ok(Some(frame)) => self.input(EdgeLinkInput::Control(frame)),
                    Ok(None) => self.input(EdgeLinkInput::StreamEnded),
                    Err(e) => {
                        if !matches!(e, FramedError::ConnectionLost { .. }) {
                            tracing::warn!(event = "edge_control_stream_error", node = %self.node, error = %e);
                        }
                        self.input(EdgeLinkInput::Lost(protocol_close_code(&e)));
                    }
                },
                () = self.clock.sleep_until(wake) => {
                    self.link.handle_timeout(self.clock.now());
                    if !self.was_live && self.link.machine().is_over() {
                        tracing::warn!(event = "edge_handshake_timeout", node = %self.node);
                    }
                },
                // The hub's commands wait for readiness.
                command = commands.recv(), if live => self.input(match command {
                    Some(LinkCommand::Close(code)) => EdgeLinkInput::Close(code),
                    Some(LinkCommand::Cancel(run_id)) => EdgeLinkInput::Cancel(run_id),
                    Some(LinkCommand::CancelParked(c)) => EdgeLinkInput::CancelParked(c),
                    Some(LinkCommand::Refresh(snapshot)) => EdgeLinkInput::Refresh(*snapshot),
                    None => EdgeLinkInput::Close(CloseCode::Shutdown),
                }),
                err = conn.closed() => {
                    self.input(EdgeLinkInput::Lost(close_code_of(&err).unwrap_or(CloseCode::Normal)));
                },
            }
            if self.drain().await {
                return;
            }
        }
    }

    /// Carry out the machine's outputs; `true` once the connection ended.
    async fn drain(&mut self) -> bool {
        while let Some(out) = self.link.poll_output(self.clock.now()) {
            match out {
                EdgeLinkOutput::Send(frame) => {
                    if let Err(e) = self.send.send(&frame).await {
                        let code = if self.link.machine().is_live() {
                            CloseCode::Normal
                        } else {
                            protocol_close_code(&e)
                        };
                        self.input(EdgeLinkInput::Lost(code));
                    }
                }
                EdgeLinkOutput::Register(request) => {
                    let Some(handle) = self.handle.take() else {
                        continue;
                    };
                    let Ok(answer) = self.hub.register(self.node.clone(), request, handle).await
                    else {
                        // The hub is gone: the Edge is shutting down.
                        close_connection(&self.conn, CloseCode::Shutdown);
                        return true;
                    };
                    if let Err(rejection) = &answer {
                        self.log_rejection(rejection);
                    }
                    self.input(EdgeLinkInput::Registered(answer));
                }
                EdgeLinkOutput::Ready(generation) => {
                    let accepted = self
                        .hub
                        .ready(self.node.clone(), generation)
                        .await
                        .unwrap_or(false);
                    self.input(EdgeLinkInput::ReadyAnswer { accepted });
                }
                EdgeLinkOutput::Connected(generation) => {
                    self.was_live = true;
                    tracing::info!(event = "edge_node_connected", node = %self.node, generation);
                }
                EdgeLinkOutput::LateMessage(generation) => {
                    self.hub.late_message(self.node.clone(), generation);
                }
                EdgeLinkOutput::Parked { generation, runs } => {
                    self.hub.parked(self.node.clone(), generation, runs);
                }
                EdgeLinkOutput::Flooded(flood) => {
                    tracing::warn!(event = "edge_node_frame_flood", node = %self.node, flood = flood.as_str());
                }
                EdgeLinkOutput::HeartbeatTimedOut => {
                    tracing::warn!(
                        event = "edge_heartbeat_timeout",
                        node = %self.node,
                        generation = self.link.machine().generation().unwrap_or(0)
                    );
                }
                EdgeLinkOutput::End { code, generation } => {
                    if code == CloseCode::RegistrationRejected {
                        let _ = self.send.finish();
                        // Let the refusal reach the node before the close.
                        let _ =
                            tokio::time::timeout(Duration::from_secs(1), self.send.stopped()).await;
                    }
                    close_connection(&self.conn, code);
                    if self.was_live {
                        tracing::info!(
                            event = "edge_node_disconnected",
                            node = %self.node,
                            generation = generation.unwrap_or(0),
                            reason = code.as_str()
                        );
                    }
                    // R-GEN-3: a generation handed out ends with its
                    // connection, whatever ended it.
                    if let Some(generation) = generation {
                        self.hub.link_closed(self.node.clone(), generation, code);
                    }
                    return true;
                }
            }
        }
        false
    }

    fn log_rejection(&self, rejection: &Rejection) {
        tracing::warn!(
            event = "edge_registration_rejected",
            node = %self.node,
            reason = rejection.reason.as_str(),
            cause = rejection.cause.as_str(),
            detail = %rejection.message
        );
    }
}
