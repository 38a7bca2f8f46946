//! Managed credential leases end to end (R-CRED-1..3): a real Edge, a real
//! Node over QUIC, and the mock provider over HTTP requiring the managed
//! key. Every refusal fails closed with `credential_rejected` and zero
//! provider requests.

mod common;

use std::time::Duration;

use common::*;
use iop_core::cred::{LeaseScope, keys, random_nonce, seal_lease};
use iop_core::ids::NodeId;
use iop_edge::server::RunningEdge;
use iop_node::RunningNode;
use iop_node::mock::{MockScript, MockServer};
use iop_transport::{FramedRecv, FramedSend, open_framed};
use iop_wire::{
    AdapterKind, ChatMessage, DataRequest, FailureCode, GenerationParams, Role, RunApi, RunEvent,
    RunEventKind, RunRequest,
};

const KEY: &str = "sk-client-key-0123456789";
/// The managed provider credential the mock requires.
const SECRET: &str = "sk-managed-provider-secret-42";

struct Rig {
    pki: Pki,
    edge: RunningEdge,
    node: RunningNode,
    mock: MockServer,
    conn: quinn::Connection,
    generation: u64,
}

/// An Edge whose provider `p` (node-1, openai target `m`) uses the managed
/// profile `k` (secret `configured`, `cred_extra` appended to its entry),
/// and a Node pointing `m` at a mock that requires [`SECRET`].
async fn rig(configured: &str, cred_extra: &str) -> Rig {
    rig_with(configured, cred_extra, "").await
}

async fn rig_with(configured: &str, cred_extra: &str, provider_extra: &str) -> Rig {
    let pki = Pki::new(&["node-1"]);
    write_secret(&pki.path().join("key"), KEY);
    write_secret(&pki.path().join("cred"), configured);
    let mock = MockServer::start(MockScript {
        require_key: Some(SECRET.into()),
        ..MockScript::default()
    })
    .await
    .unwrap();
    let edge = RunningEdge::start(edge_config(
        &pki,
        0,
        &format!(
            "[[credentials]]\nprofile = \"k\"\nsecret_file = \"cred\"\n{cred_extra}\n\
             [[providers]]\nid = \"p\"\nnode = \"node-1\"\nadapter = \"openai\"\ntarget = \"m\"\ncredential = \"k\"\n{provider_extra}\n\
             [[routes]]\nmodel = \"mock\"\nproviders = [\"p\"]\n\
             [[api_keys]]\nprincipal = \"tester\"\nkey_file = \"key\"\nadmin = true\n"
        ),
    ))
    .await
    .expect("edge");
    let node = start_node(
        &pki,
        "node-1",
        edge.quic_addr,
        &format!(
            "[[providers]]\nadapter = \"openai\"\ntarget = \"m\"\nbase_url = \"{}\"\n",
            mock.base_url()
        ),
    );
    let generation = ready_generation(&edge, "node-1").await;
    let (_, link) = edge.hub.link("node-1".into()).await.unwrap().unwrap();
    Rig {
        pki,
        edge,
        node,
        mock,
        conn: link.conn,
        generation,
    }
}

impl Rig {
    async fn chat(&self) -> (u16, String) {
        let r = reqwest::Client::new()
            .post(format!(
                "http://{}/v1/chat/completions",
                self.edge.http_addr
            ))
            .bearer_auth(KEY)
            .header("content-type", "application/json")
            .body(r#"{"model":"mock","messages":[{"role":"user","content":"hi"}]}"#)
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    }

    fn signing_key(&self) -> ed25519_dalek::SigningKey {
        let bytes = std::fs::read(self.pki.path().join("edge-state/lease-signing.key")).unwrap();
        keys::signing_key_from_bytes(&bytes).unwrap()
    }

    fn recipient(&self) -> x25519_dalek::PublicKey {
        let bytes = std::fs::read(self.pki.path().join("node-node-1-state/recipient.key")).unwrap();
        keys::recipient_public_key(&keys::recipient_secret_from_bytes(&bytes).unwrap())
    }

    /// A lease the Edge would seal for `run_id`, changed by `edit`.
    fn scope(&self, run_id: u64) -> LeaseScope {
        let now = iop_transport::clock::unix_ms();
        LeaseScope {
            principal: "tester".into(),
            route: "mock".into(),
            slot: run_id,
            profile: "k".into(),
            target: "m".into(),
            node: NodeId::new("node-1"),
            credential_revision: 1,
            generation: self.generation,
            issued_at_unix_ms: now,
            expires_at_unix_ms: now + iop_core::cred::DEFAULT_LEASE_LIFETIME_MS,
            nonce: random_nonce(&mut rand::rng()),
        }
    }

    fn seal(&self, scope: &LeaseScope) -> Vec<u8> {
        seal_lease(
            scope,
            SECRET.as_bytes(),
            &self.signing_key(),
            &self.recipient(),
            &mut rand::rng(),
        )
        .unwrap()
        .to_bytes()
    }

    /// Send a crafted run over the node link; its events.
    async fn run(&self, run_id: u64, lease: Option<Vec<u8>>) -> Vec<RunEventKind> {
        let (mut send, mut recv): (FramedSend, FramedRecv) = open_framed(&self.conn).await.unwrap();
        send.send(&DataRequest::Run(run_request(run_id, lease)))
            .await
            .unwrap();
        let _ = send.finish();
        let mut events = Vec::new();
        while let Some(ev) = recv.recv::<RunEvent>().await.expect("stream") {
            events.push(ev.kind);
        }
        events
    }

    /// The run fails closed: `credential_rejected`, no provider request,
    /// and the node counted `reason`.
    async fn assert_rejected(&self, what: &str, run_id: u64, lease: Option<Vec<u8>>, reason: &str) {
        let before = self.mock.requests();
        let events = self.run(run_id, lease).await;
        match events.as_slice() {
            [RunEventKind::Failed(f)] => {
                assert_eq!(
                    f.code,
                    FailureCode::CredentialRejected,
                    "{what}: {events:?}"
                )
            }
            other => panic!("{what}: expected one credential_rejected terminal, got {other:?}"),
        }
        assert_eq!(
            self.mock.requests(),
            before,
            "{what}: no provider request may be made"
        );
        let metrics = self.node.shared().metrics.render();
        assert!(
            metrics.contains(&format!("reason=\"{reason}\"")),
            "{what}: the node counted {reason}: {metrics}"
        );
    }
}

fn run_request(run_id: u64, lease: Option<Vec<u8>>) -> RunRequest {
    RunRequest {
        run_id,
        session_id: "s".into(),
        adapter: AdapterKind::OpenAi,
        target: "m".into(),
        model: "mock".into(),
        api: RunApi::Chat,
        messages: vec![ChatMessage {
            role: Role::User,
            content: "hello".into(),
            tool_calls: vec![],
            tool_call_id: None,
            name: None,
            images: Vec::new(),
            cache_control: None,
            documents: Vec::new(),
        }],
        tools: vec![],
        params: GenerationParams::default(),
        response_stall_timeout_ms: 0,
        deadline_ms: 0,
        credential_lease: lease,
        trace_context: None,
        park: None,
        continue_final: false,
    }
}

fn completed(events: &[RunEventKind]) -> bool {
    matches!(events.last(), Some(RunEventKind::Completed { .. }))
}

fn assert_credential_rejected(status: u16, body: &str) {
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("credential"), "{body}");
    assert!(!body.contains(SECRET), "the secret never reaches a client");
}

#[tokio::test]
async fn managed_provider_answers_through_the_edge_with_the_leased_key() {
    bounded(async {
        let rig = rig(SECRET, "").await;
        for _ in 0..3 {
            let (status, body) = rig.chat().await;
            assert_eq!(status, 200, "{body}");
            assert!(!body.contains(SECRET));
        }
        // One provider request per client request: the key was accepted.
        assert_eq!(rig.mock.requests(), 3);
        // Keys are on disk with mode 0600.
        use std::os::unix::fs::PermissionsExt;
        for file in [
            "edge-state/lease-signing.key",
            "node-node-1-state/recipient.key",
        ] {
            let mode = std::fs::metadata(rig.pki.path().join(file))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600, "{file}");
        }
        rig.node.shutdown().await.unwrap();
        rig.edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn a_tunnel_mode_provider_gets_its_lease_too() {
    bounded(async {
        let rig = rig_with(SECRET, "", "mode = \"tunnel\"").await;
        let (status, body) = rig.chat().await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(rig.mock.requests(), 1);
        // Revoked: the tunnel fails closed as well, before any request.
        assert!(rig.edge.revoke_credential("k"));
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (status, body) = rig.chat().await;
        assert_credential_rejected(status, &body);
        assert_eq!(rig.mock.requests(), 1);
        rig.node.shutdown().await.unwrap();
        rig.edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn a_wrong_configured_secret_is_refused_by_the_provider() {
    bounded(async {
        let rig = rig("sk-not-the-right-one", "").await;
        let (status, body) = rig.chat().await;
        assert_ne!(status, 200, "{body}");
        assert!(!body.contains("sk-not-the-right-one"));
        // The provider saw only refused calls (401): no successful call.
        assert!(rig.mock.requests() >= 1);
        rig.node.shutdown().await.unwrap();
        rig.edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn revoked_by_the_admin_endpoint_fails_closed() {
    bounded(async {
        let rig = rig(SECRET, "").await;
        assert_eq!(rig.chat().await.0, 200);
        let http = reqwest::Client::new();
        let url = format!("http://{}/admin/credentials/k/revoke", rig.edge.http_addr);
        // Not without the admin key.
        let denied = http.post(&url).send().await.unwrap();
        assert_eq!(denied.status().as_u16(), 401);
        let r = http.post(&url).bearer_auth(KEY).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let unknown = http
            .post(format!(
                "http://{}/admin/credentials/nope/revoke",
                rig.edge.http_addr
            ))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap();
        assert_eq!(unknown.status().as_u16(), 404);
        // R-CRED-3: at once, before the node hears the refresh on the
        // control stream, the Edge seals no lease for the revoked profile,
        // so the node refuses the managed target without calling it.
        let before = rig.mock.requests();
        let (status, body) = rig.chat().await;
        assert_credential_rejected(status, &body);
        assert_eq!(rig.mock.requests(), before, "no provider request");
        assert!(
            rig.node
                .shared()
                .metrics
                .render()
                .contains("reason=\"missing_lease\"")
        );
        // And still after the refresh arrived.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (status, body) = rig.chat().await;
        assert_credential_rejected(status, &body);
        assert_eq!(rig.mock.requests(), before, "no provider request");
        rig.node.shutdown().await.unwrap();
        rig.edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn a_disabled_profile_fails_closed() {
    bounded(async {
        let rig = rig(SECRET, "disabled = true").await;
        let (status, body) = rig.chat().await;
        assert_credential_rejected(status, &body);
        assert_eq!(rig.mock.requests(), 0);
        rig.assert_rejected("disabled", 900, Some(rig.seal(&rig.scope(900))), "disabled")
            .await;
        rig.node.shutdown().await.unwrap();
        rig.edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn a_rotated_revision_makes_old_leases_stale() {
    bounded(async {
        let rig = rig(SECRET, "").await;
        // A lease of revision 1, sealed before the rotation.
        let old = rig.seal(&rig.scope(700));
        // Rotation: revision 2 (what SIGHUP applies after re-reading the file).
        let mut profiles = rig.edge.config.credentials.clone();
        profiles[0].revision = 2;
        rig.edge.reload_credentials(&profiles);
        tokio::time::sleep(Duration::from_millis(300)).await;
        rig.assert_rejected("stale revision", 700, Some(old), "stale_revision")
            .await;
        // New leases carry revision 2 and work.
        let (status, body) = rig.chat().await;
        assert_eq!(status, 200, "{body}");
        // A lease of a revision newer than the node knows is refused too.
        let mut newer = rig.scope(701);
        newer.credential_revision = 3;
        rig.assert_rejected(
            "newer revision",
            701,
            Some(rig.seal(&newer)),
            "stale_revision",
        )
        .await;
        // The profile removed from the config (reload): revoked.
        rig.edge.reload_credentials(&[]);
        tokio::time::sleep(Duration::from_millis(300)).await;
        rig.assert_rejected(
            "removed profile",
            702,
            Some(rig.seal(&rig.scope(702))),
            "revoked",
        )
        .await;
        // The Edge has no secret to lease any more: the node refuses the
        // managed target without a lease (no fallback credential).
        let before = rig.mock.requests();
        let (status, body) = rig.chat().await;
        assert_credential_rejected(status, &body);
        assert_eq!(rig.mock.requests(), before);
        rig.node.shutdown().await.unwrap();
        rig.edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn every_bad_lease_fails_closed_with_no_provider_request() {
    bounded(async {
        let rig = rig(SECRET, "").await;
        // Control: a well-formed crafted lease opens and the call succeeds.
        let good = rig.seal(&rig.scope(100));
        let events = rig.run(100, Some(good.clone())).await;
        assert!(completed(&events), "{events:?}");
        assert_eq!(rig.mock.requests(), 1);

        // Replayed: the same frame again (same lease, same run id). On one
        // connection the watchdog's run-id uniqueness refuses it at
        // admission, before the lease is opened, as `credential_rejected`
        // (the replay cache is the second line, behind it); on another
        // connection the generation binding refuses it. Either way: no
        // provider request.
        let rejections = rig
            .node
            .shared()
            .credential_rejections
            .load(std::sync::atomic::Ordering::Relaxed);
        let events = rig.run(100, Some(good.clone())).await;
        assert!(
            matches!(events.as_slice(), [RunEventKind::Failed(f)] if f.code == FailureCode::CredentialRejected),
            "{events:?}"
        );
        assert_eq!(rig.mock.requests(), 1, "a replay makes no provider request");
        assert_eq!(
            rig.node
                .shared()
                .credential_rejections
                .load(std::sync::atomic::Ordering::Relaxed),
            rejections,
            "the replayed lease was never opened"
        );
        // The same lease carried by another run: bound to its slot.
        rig.assert_rejected("replayed on another run", 99, Some(good), "binding_mismatch_slot")
            .await;

        // Missing: a managed target without a lease; no fallback key.
        rig.assert_rejected("missing", 101, None, "missing_lease")
            .await;

        // Expired (beyond the skew tolerance).
        let mut s = rig.scope(102);
        let past = s.issued_at_unix_ms - 10 * 60 * 1000;
        s.issued_at_unix_ms = past;
        s.expires_at_unix_ms = past + 60 * 1000;
        rig.assert_rejected("expired", 102, Some(rig.seal(&s)), "expired")
            .await;

        // Wrong recipient: sealed to another node's key.
        let other = keys::recipient_public_key(&keys::generate_recipient_key(&mut rand::rng()));
        let sealed = seal_lease(
            &rig.scope(103),
            SECRET.as_bytes(),
            &rig.signing_key(),
            &other,
            &mut rand::rng(),
        )
        .unwrap()
        .to_bytes();
        rig.assert_rejected("wrong recipient", 103, Some(sealed), "wrong_recipient")
            .await;

        // Tampered ciphertext (the byte before the signature).
        let mut bytes = rig.seal(&rig.scope(104));
        let at = bytes.len() - 64 - 1;
        bytes[at] ^= 0x01;
        rig.assert_rejected("tampered ciphertext", 104, Some(bytes), "tampered")
            .await;

        // Tampered scope (a byte inside the postcard scope).
        let mut bytes = rig.seal(&rig.scope(105));
        bytes[69 + 3] ^= 0x01;
        rig.assert_rejected("tampered scope", 105, Some(bytes), "tampered")
            .await;

        // Signed by someone else.
        let forger = keys::generate_signing_key(&mut rand::rng());
        let forged = seal_lease(
            &rig.scope(106),
            SECRET.as_bytes(),
            &forger,
            &rig.recipient(),
            &mut rand::rng(),
        )
        .unwrap()
        .to_bytes();
        rig.assert_rejected("forged", 106, Some(forged), "bad_signature")
            .await;

        // Bound fields: another run (slot), generation, target.
        let lease = rig.seal(&rig.scope(999));
        rig.assert_rejected("wrong slot", 107, Some(lease), "binding_mismatch_slot")
            .await;
        let mut s = rig.scope(108);
        s.generation = rig.generation - 1;
        rig.assert_rejected(
            "wrong generation",
            108,
            Some(rig.seal(&s)),
            "binding_mismatch_generation",
        )
        .await;
        let mut s = rig.scope(109);
        s.target = "elsewhere".into();
        rig.assert_rejected(
            "wrong target",
            109,
            Some(rig.seal(&s)),
            "binding_mismatch_target",
        )
        .await;

        // A lease naming another profile than the target's.
        let mut s = rig.scope(110);
        s.profile = "ghost".into();
        rig.assert_rejected(
            "other profile",
            110,
            Some(rig.seal(&s)),
            "binding_mismatch_profile",
        )
        .await;

        assert_eq!(
            rig.mock.requests(),
            1,
            "only the control call reached the provider"
        );
        // The node is still healthy: a fresh good lease works.
        let events = rig.run(111, Some(rig.seal(&rig.scope(111)))).await;
        assert!(completed(&events), "{events:?}");
        rig.node.shutdown().await.unwrap();
        rig.edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn a_node_refuses_to_start_with_a_world_readable_recipient_key() {
    bounded(async {
        use std::os::unix::fs::PermissionsExt;
        let rig = rig(SECRET, "").await;
        rig.node.shutdown().await.unwrap();
        let path = rig.pki.path().join("node-node-1-state/recipient.key");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let node = start_node(&rig.pki, "node-1", rig.edge.quic_addr, "");
        let err = node.shutdown().await.expect_err("must refuse to start");
        assert!(err.to_string().contains("0600"), "{err}");
        rig.edge.shutdown().await;
    })
    .await;
}
