//! Credential lease tests: each rule of R-CRED-1..3 as a test.

use chacha20::ChaCha20Rng;
use ed25519_dalek::SigningKey;
use proptest::prelude::*;
use rand_core::SeedableRng;
use x25519_dalek::StaticSecret;

use super::keys::{generate_recipient_key, generate_signing_key, recipient_public_key};
use super::lease::{HEADER_LEN, SIGNATURE_LEN, TAG_LEN};
use super::*;
use crate::ids::NodeId;

/// A deterministic CSPRNG (ChaCha20 from a fixed seed) so every test is
/// reproducible. Tests only: the shells pass an OS-seeded generator.
pub(crate) fn test_rng(seed: u64) -> ChaCha20Rng {
    ChaCha20Rng::seed_from_u64(seed)
}

const SECRET: &[u8] = b"sk-test-THIS-MUST-NEVER-LEAK-0123456789";
const ISSUED_AT_MS: u64 = 1_800_000_000_000;
const LIFETIME_MS: u64 = DEFAULT_LEASE_LIFETIME_MS;
const EXPIRES_AT_MS: u64 = ISSUED_AT_MS + LIFETIME_MS;
const SKEW_MS: u64 = DEFAULT_SKEW_TOLERANCE_MS;
const NOW_MS: u64 = ISSUED_AT_MS + 1_000;
const REVISION: u64 = 7;

/// One Edge, one Node, one dispatch.
struct Fixture {
    rng: ChaCha20Rng,
    edge: SigningKey,
    node: StaticSecret,
    scope: LeaseScope,
}

impl Fixture {
    fn new(seed: u64) -> Self {
        let mut rng = test_rng(seed);
        let edge = generate_signing_key(&mut rng);
        let node = generate_recipient_key(&mut rng);
        let scope = LeaseScope {
            principal: "team-a".to_owned(),
            route: "gpt-4o".to_owned(),
            slot: 42,
            profile: "openai-prod".to_owned(),
            target: "api.openai.com".to_owned(),
            node: NodeId::new("node-1"),
            credential_revision: REVISION,
            generation: 3,
            issued_at_unix_ms: ISSUED_AT_MS,
            expires_at_unix_ms: EXPIRES_AT_MS,
            nonce: random_nonce(&mut rng),
        };
        Fixture {
            rng,
            edge,
            node,
            scope,
        }
    }

    fn seal(&mut self) -> Vec<u8> {
        let recipient = recipient_public_key(&self.node);
        seal_lease(&self.scope, SECRET, &self.edge, &recipient, &mut self.rng)
            .expect("valid scope seals")
            .to_bytes()
    }

    fn expected(&self) -> ExpectedBinding<'_> {
        ExpectedBinding {
            node: "node-1",
            generation: 3,
            slot: 42,
            target: "api.openai.com",
            profile: "openai-prod",
            route: Some("gpt-4o"),
            principal: None,
        }
    }

    fn open_at(
        &self,
        bytes: &[u8],
        now_ms: u64,
        replay: &mut ReplayCache,
    ) -> Result<Secret, CredentialRejected> {
        open_lease(
            bytes,
            &self.expected(),
            &self.edge.verifying_key(),
            &self.node,
            now_ms,
            SKEW_MS,
            replay,
            &active_at(REVISION),
        )
    }

    fn open(&self, bytes: &[u8]) -> Result<Secret, CredentialRejected> {
        self.open_at(bytes, NOW_MS, &mut ReplayCache::new())
    }
}

/// Credential state: the fixture's profile at `revision`, active.
fn active_at(revision: u64) -> impl Fn(&str) -> Option<(u64, bool)> {
    move |profile: &str| (profile == "openai-prod").then_some((revision, true))
}

/// Asserts `result` is a rejection for `reason` whose text shows no secret.
fn assert_rejected(result: Result<Secret, CredentialRejected>, reason: RejectionReason) {
    match result {
        Ok(secret) => panic!("expected {reason}, opened {secret:?}"),
        Err(rejected) => {
            assert_eq!(rejected.reason, reason);
            assert_eq!(
                rejected.failure_code(),
                iop_wire::FailureCode::CredentialRejected
            );
            for text in [format!("{rejected}"), format!("{rejected:?}")] {
                assert!(!text.contains("sk-test"), "secret in {text}");
            }
        }
    }
}

/// Offsets inside an envelope, read from its header.
fn scope_range(bytes: &[u8]) -> std::ops::Range<usize> {
    let len = u32::from_be_bytes(
        bytes[HEADER_LEN - 4..HEADER_LEN]
            .try_into()
            .expect("4 bytes"),
    ) as usize;
    HEADER_LEN..HEADER_LEN + len
}

fn ciphertext_range(bytes: &[u8]) -> std::ops::Range<usize> {
    scope_range(bytes).end..bytes.len() - SIGNATURE_LEN
}

fn flip_bit(bytes: &[u8], bit: usize) -> Vec<u8> {
    let mut out = bytes.to_vec();
    out[bit / 8] ^= 1 << (bit % 8);
    out
}

// --- R-CRED-1: the happy path ---------------------------------------------

#[test]
fn a_sealed_lease_opens_to_its_secret_on_its_node() {
    let mut f = Fixture::new(1);
    let bytes = f.seal();
    let secret = f.open(&bytes).expect("valid lease opens");
    assert_eq!(secret.expose_secret(), SECRET);
    assert_eq!(secret.len(), SECRET.len());
    assert!(!secret.is_empty());
}

#[test]
fn the_envelope_round_trips_and_carries_no_plaintext() {
    let mut f = Fixture::new(2);
    let recipient = recipient_public_key(&f.node);
    let lease = seal_lease(&f.scope, SECRET, &f.edge, &recipient, &mut f.rng).expect("seals");
    let bytes = lease.to_bytes();
    assert_eq!(bytes[0], LEASE_FORMAT_VERSION);
    assert_eq!(SealedLease::from_bytes(&bytes), Ok(lease.clone()));
    assert_eq!(lease.recipient_public_key(), recipient.to_bytes());
    assert!(!bytes.windows(SECRET.len()).any(|w| w == SECRET));
    assert!(!format!("{lease:?}").contains("sk-test"));
}

#[test]
fn sealing_is_deterministic_given_the_injected_rng() {
    let a = Fixture::new(3).seal();
    let b = Fixture::new(3).seal();
    let c = Fixture::new(4).seal();
    assert_eq!(a, b);
    assert_ne!(a, c);
}

#[test]
fn two_leases_for_the_same_scope_use_distinct_ephemeral_keys() {
    let mut f = Fixture::new(5);
    let a = f.seal();
    let b = f.seal();
    assert_ne!(a[1..33], b[1..33]);
    assert_ne!(a[ciphertext_range(&a)], b[ciphertext_range(&b)]);
}

#[test]
fn the_secret_debug_output_is_redacted() {
    let mut f = Fixture::new(6);
    let bytes = f.seal();
    let secret = f.open(&bytes).expect("opens");
    assert_eq!(format!("{secret:?}"), "Secret(<redacted>)");
}

#[test]
fn the_largest_secret_and_scope_fit_the_envelope_bound() {
    let mut f = Fixture::new(7);
    // Grow the principal until the encoded scope is exactly MAX_SCOPE_BYTES.
    let base = postcard::to_allocvec(&f.scope).expect("encodes").len();
    f.scope
        .principal
        .push_str(&"p".repeat(MAX_SCOPE_BYTES - base - 1));
    let mut len = postcard::to_allocvec(&f.scope).expect("encodes").len();
    while len > MAX_SCOPE_BYTES {
        f.scope.principal.pop();
        len = postcard::to_allocvec(&f.scope).expect("encodes").len();
    }
    let big_secret = vec![0x5a; MAX_SECRET_BYTES];
    let recipient = recipient_public_key(&f.node);
    let bytes = seal_lease(&f.scope, &big_secret, &f.edge, &recipient, &mut f.rng)
        .expect("largest lease seals")
        .to_bytes();
    // The bound is the largest lease exactly: what this one lacks of it is
    // what its scope lacks of the largest scope.
    assert_eq!(MAX_SEALED_LEASE_BYTES - bytes.len(), MAX_SCOPE_BYTES - len);
    let secret = f.open(&bytes).expect("largest lease opens");
    assert_eq!(secret.expose_secret(), &big_secret[..]);
}

#[test]
fn a_sealed_leases_debug_output_shows_only_lengths() {
    let mut f = Fixture::new(8);
    let recipient = recipient_public_key(&f.node);
    let sealed = seal_lease(&f.scope, SECRET, &f.edge, &recipient, &mut f.rng).expect("seals");
    let scope_len = postcard::to_allocvec(&f.scope).expect("encodes").len();
    let shown = format!("{sealed:?}");
    assert!(
        shown.starts_with("SealedLease { version: 1, scope_len: ")
            && shown.contains(&format!("scope_len: {scope_len},")),
        "{shown}"
    );
    assert!(shown.ends_with(".. }"), "{shown}");
}

/// The limits docs/credentials.md states (R-LIM: what a stranger's lease
/// may make a Node spend).
#[test]
fn the_limits_are_the_documented_ones() {
    assert_eq!(MAX_SCOPE_BYTES, 4 * 1024, "4 KiB");
    assert_eq!(MAX_SECRET_BYTES, 16 * 1024, "16 KiB");
    assert_eq!(MAX_LEASE_LIFETIME_MS, 15 * 60_000, "15 min");
    assert_eq!(DEFAULT_LEASE_LIFETIME_MS, 2 * 60_000, "2 min");
    assert_eq!(DEFAULT_SKEW_TOLERANCE_MS, 30_000, "30 s");
}

// --- R-CRED-3: every rejection fails closed with its reason ---------------

#[test]
fn a_revoked_profile_is_refused() {
    let mut f = Fixture::new(10);
    let bytes = f.seal();
    let unknown = |_: &str| None;
    let result = open_lease(
        &bytes,
        &f.expected(),
        &f.edge.verifying_key(),
        &f.node,
        NOW_MS,
        SKEW_MS,
        &mut ReplayCache::new(),
        &unknown,
    );
    assert_rejected(result, RejectionReason::Revoked);
}

#[test]
fn a_disabled_profile_is_refused() {
    let mut f = Fixture::new(11);
    let bytes = f.seal();
    let disabled = |_: &str| Some((REVISION, false));
    let result = open_lease(
        &bytes,
        &f.expected(),
        &f.edge.verifying_key(),
        &f.node,
        NOW_MS,
        SKEW_MS,
        &mut ReplayCache::new(),
        &disabled,
    );
    assert_rejected(result, RejectionReason::Disabled);
}

#[test]
fn a_lease_of_another_revision_is_stale() {
    let mut f = Fixture::new(12);
    let bytes = f.seal();
    // The credential was rotated after sealing, and (fail closed) the Node
    // not yet knowing the lease's newer revision.
    for current in [REVISION + 1, REVISION - 1] {
        let result = open_lease(
            &bytes,
            &f.expected(),
            &f.edge.verifying_key(),
            &f.node,
            NOW_MS,
            SKEW_MS,
            &mut ReplayCache::new(),
            &active_at(current),
        );
        assert_rejected(result, RejectionReason::StaleRevision);
    }
}

#[test]
fn an_expired_lease_is_refused_once_the_skew_tolerance_has_passed() {
    let mut f = Fixture::new(13);
    let bytes = f.seal();
    // Inside the tolerance: the Node's clock runs up to SKEW_MS ahead of the Edge's.
    let last_ok = EXPIRES_AT_MS + SKEW_MS - 1;
    assert!(f.open_at(&bytes, last_ok, &mut ReplayCache::new()).is_ok());
    assert_rejected(
        f.open_at(&bytes, EXPIRES_AT_MS + SKEW_MS, &mut ReplayCache::new()),
        RejectionReason::Expired,
    );
    assert_rejected(
        f.open_at(&bytes, u64::MAX, &mut ReplayCache::new()),
        RejectionReason::Expired,
    );
}

#[test]
fn a_lease_issued_in_the_future_is_refused_beyond_the_skew_tolerance() {
    let mut f = Fixture::new(14);
    let bytes = f.seal();
    // The Node's clock runs up to SKEW_MS behind the Edge's: accepted.
    assert!(
        f.open_at(&bytes, ISSUED_AT_MS - SKEW_MS, &mut ReplayCache::new())
            .is_ok()
    );
    assert_rejected(
        f.open_at(&bytes, ISSUED_AT_MS - SKEW_MS - 1, &mut ReplayCache::new()),
        RejectionReason::NotYetValid,
    );
}

#[test]
fn a_zero_skew_tolerance_checks_the_exact_window() {
    let mut f = Fixture::new(15);
    let bytes = f.seal();
    let open = |now| {
        open_lease(
            &bytes,
            &f.expected(),
            &f.edge.verifying_key(),
            &f.node,
            now,
            0,
            &mut ReplayCache::new(),
            &active_at(REVISION),
        )
    };
    assert!(open(ISSUED_AT_MS).is_ok());
    assert!(open(EXPIRES_AT_MS - 1).is_ok());
    assert_rejected(open(ISSUED_AT_MS - 1), RejectionReason::NotYetValid);
    assert_rejected(open(EXPIRES_AT_MS), RejectionReason::Expired);
}

#[test]
fn a_replayed_lease_is_refused() {
    let mut f = Fixture::new(16);
    let bytes = f.seal();
    let mut replay = ReplayCache::new();
    assert!(f.open_at(&bytes, NOW_MS, &mut replay).is_ok());
    assert_rejected(
        f.open_at(&bytes, NOW_MS + 1, &mut replay),
        RejectionReason::Replayed,
    );
    // Until it expires; after that it is refused as expired, never accepted.
    assert_rejected(
        f.open_at(&bytes, EXPIRES_AT_MS + SKEW_MS, &mut replay),
        RejectionReason::Expired,
    );
    // Its entry is kept exactly that long, then evicted.
    replay.evict_expired(EXPIRES_AT_MS + SKEW_MS - 1);
    assert_eq!(replay.len(), 1);
    replay.evict_expired(EXPIRES_AT_MS + SKEW_MS);
    assert!(replay.is_empty());
}

#[test]
fn a_reused_nonce_in_a_fresh_lease_is_refused_as_replayed() {
    let mut f = Fixture::new(17);
    let first = f.seal();
    let second = f.seal(); // same scope, same nonce, new ephemeral key
    assert_ne!(first, second);
    let mut replay = ReplayCache::new();
    assert!(f.open_at(&first, NOW_MS, &mut replay).is_ok());
    assert_rejected(
        f.open_at(&second, NOW_MS, &mut replay),
        RejectionReason::Replayed,
    );
}

#[test]
fn a_full_replay_cache_refuses_leases() {
    let mut f = Fixture::new(18);
    let first = f.seal();
    f.scope.nonce = random_nonce(&mut f.rng);
    let second = f.seal();
    let mut replay = ReplayCache::with_capacity(1);
    assert!(f.open_at(&first, NOW_MS, &mut replay).is_ok());
    assert_rejected(
        f.open_at(&second, NOW_MS, &mut replay),
        RejectionReason::ReplayCacheFull,
    );
}

#[test]
fn a_lease_for_another_node_key_is_refused_as_wrong_recipient() {
    let mut f = Fixture::new(19);
    let bytes = f.seal();
    let other_node = generate_recipient_key(&mut f.rng);
    let result = open_lease(
        &bytes,
        &f.expected(),
        &f.edge.verifying_key(),
        &other_node,
        NOW_MS,
        SKEW_MS,
        &mut ReplayCache::new(),
        &active_at(REVISION),
    );
    assert_rejected(result, RejectionReason::WrongRecipient);
}

#[test]
fn a_lease_relabelled_for_another_node_key_cannot_be_decrypted() {
    // An attacker rewrites the recipient field to the key of the Node that
    // holds the lease: it passes the recipient check but not the AEAD.
    let mut f = Fixture::new(20);
    let bytes = f.seal();
    let other_node = generate_recipient_key(&mut f.rng);
    let mut relabelled = bytes.clone();
    relabelled[33..65].copy_from_slice(&recipient_public_key(&other_node).to_bytes());
    let result = open_lease(
        &relabelled,
        &f.expected(),
        &f.edge.verifying_key(),
        &other_node,
        NOW_MS,
        SKEW_MS,
        &mut ReplayCache::new(),
        &active_at(REVISION),
    );
    assert_rejected(result, RejectionReason::Tampered);
}

#[test]
fn a_tampered_ciphertext_is_refused() {
    let mut f = Fixture::new(21);
    let bytes = f.seal();
    for i in ciphertext_range(&bytes) {
        assert_rejected(f.open(&flip_bit(&bytes, i * 8)), RejectionReason::Tampered);
    }
}

#[test]
fn a_tampered_scope_is_refused() {
    let mut f = Fixture::new(22);
    let bytes = f.seal();
    for i in scope_range(&bytes) {
        assert_rejected(
            f.open(&flip_bit(&bytes, i * 8 + 3)),
            RejectionReason::Tampered,
        );
    }
    // A tampered ephemeral key is tampering too.
    assert_rejected(f.open(&flip_bit(&bytes, 8)), RejectionReason::Tampered);
}

#[test]
fn a_lease_signed_by_another_key_is_refused() {
    let mut f = Fixture::new(23);
    let impostor = generate_signing_key(&mut f.rng);
    let recipient = recipient_public_key(&f.node);
    let bytes = seal_lease(&f.scope, SECRET, &impostor, &recipient, &mut f.rng)
        .expect("seals")
        .to_bytes();
    assert_rejected(f.open(&bytes), RejectionReason::BadSignature);
}

#[test]
fn an_altered_signature_is_refused() {
    let mut f = Fixture::new(24);
    let bytes = f.seal();
    let start = bytes.len() - SIGNATURE_LEN;
    for i in start..bytes.len() {
        assert_rejected(
            f.open(&flip_bit(&bytes, i * 8 + 5)),
            RejectionReason::BadSignature,
        );
    }
}

#[test]
fn a_secret_substituted_by_anyone_but_the_edge_is_refused() {
    // Anyone can encrypt to a Node's public key. Splicing the Edge's
    // signature onto an attacker's ciphertext for the same scope must fail:
    // the signature covers the ephemeral key and the ciphertext.
    let mut f = Fixture::new(25);
    let genuine = f.seal();
    let attacker = generate_signing_key(&mut f.rng);
    let recipient = recipient_public_key(&f.node);
    let mut forged = seal_lease(
        &f.scope,
        b"attacker-controlled-key",
        &attacker,
        &recipient,
        &mut f.rng,
    )
    .expect("seals")
    .to_bytes();
    let n = forged.len();
    forged[n - SIGNATURE_LEN..].copy_from_slice(&genuine[genuine.len() - SIGNATURE_LEN..]);
    assert_rejected(f.open(&forged), RejectionReason::BadSignature);
}

#[test]
fn a_mismatch_on_each_bound_field_is_refused_with_that_field() {
    let mut f = Fixture::new(26);
    let bytes = f.seal();
    for field in BindingField::ALL {
        let mut expected = f.expected();
        match field {
            BindingField::Node => expected.node = "node-2",
            BindingField::Generation => expected.generation = 4,
            BindingField::Slot => expected.slot = 43,
            BindingField::Target => expected.target = "other.example",
            BindingField::Profile => expected.profile = "openai-staging",
            BindingField::Route => expected.route = Some("gpt-4o-mini"),
            BindingField::Principal => expected.principal = Some("team-b"),
        }
        let mut replay = ReplayCache::new();
        let result = open_lease(
            &bytes,
            &expected,
            &f.edge.verifying_key(),
            &f.node,
            NOW_MS,
            SKEW_MS,
            &mut replay,
            &|_: &str| Some((REVISION, true)),
        );
        assert_rejected(result, RejectionReason::BindingMismatch { field });
        // A refused lease never occupies the replay cache.
        assert!(replay.is_empty());
    }
}

#[test]
fn route_and_principal_are_checked_only_when_the_node_knows_them() {
    let mut f = Fixture::new(27);
    let bytes = f.seal();
    let mut expected = f.expected();
    expected.route = None;
    expected.principal = Some("team-a");
    let result = open_lease(
        &bytes,
        &expected,
        &f.edge.verifying_key(),
        &f.node,
        NOW_MS,
        SKEW_MS,
        &mut ReplayCache::new(),
        &active_at(REVISION),
    );
    assert!(result.is_ok());
}

#[test]
fn a_refused_lease_does_not_consume_its_nonce() {
    let mut f = Fixture::new(28);
    let bytes = f.seal();
    let mut replay = ReplayCache::new();
    let disabled = |_: &str| Some((REVISION, false));
    let result = open_lease(
        &bytes,
        &f.expected(),
        &f.edge.verifying_key(),
        &f.node,
        NOW_MS,
        SKEW_MS,
        &mut replay,
        &disabled,
    );
    assert_rejected(result, RejectionReason::Disabled);
    assert!(replay.is_empty());
    assert!(f.open_at(&bytes, NOW_MS, &mut replay).is_ok());
    assert!(!replay.is_empty(), "an opened lease's nonce is kept");
}

#[test]
fn malformed_envelopes_are_refused() {
    let mut f = Fixture::new(29);
    let bytes = f.seal();
    assert_rejected(f.open(&[]), RejectionReason::Malformed);
    assert_rejected(f.open(&bytes[..HEADER_LEN]), RejectionReason::Malformed);
    // The envelope has no total length: a cut or an extension moves the
    // signature boundary into the ciphertext, which the AEAD catches.
    assert_rejected(f.open(&bytes[..bytes.len() - 1]), RejectionReason::Tampered);
    let mut longer = bytes.clone();
    longer.push(0);
    assert_rejected(f.open(&longer), RejectionReason::Tampered);
    let mut huge = bytes.clone();
    huge.resize(MAX_SEALED_LEASE_BYTES + 1, 0);
    assert_rejected(f.open(&huge), RejectionReason::Malformed);
    // Scope length 0, and one past the maximum.
    for scope_len in [0u32, MAX_SCOPE_BYTES as u32 + 1, u32::MAX] {
        let mut bad = bytes.clone();
        bad[HEADER_LEN - 4..HEADER_LEN].copy_from_slice(&scope_len.to_be_bytes());
        assert_rejected(f.open(&bad), RejectionReason::Malformed);
    }
    // A ciphertext with nothing but a tag.
    let range = ciphertext_range(&bytes);
    let mut tag_only = bytes[..range.start].to_vec();
    tag_only.extend_from_slice(&bytes[range.end - TAG_LEN..]);
    assert_rejected(f.open(&tag_only), RejectionReason::Malformed);
    // A ciphertext one byte longer than the largest secret's, under a small
    // scope, so the whole is within the sealed-lease bound.
    let mut over = bytes[..range.start].to_vec();
    over.resize(over.len() + MAX_SECRET_BYTES + TAG_LEN + 1, 0);
    over.extend_from_slice(&bytes[bytes.len() - SIGNATURE_LEN..]);
    assert!(over.len() <= MAX_SEALED_LEASE_BYTES);
    assert_rejected(f.open(&over), RejectionReason::Malformed);
}

#[test]
fn a_secret_reports_its_length() {
    let empty = Secret::new(zeroize::Zeroizing::new(Vec::new()));
    assert!(empty.is_empty());
    assert_eq!(empty.expose_secret(), b"");
    let one = Secret::new(zeroize::Zeroizing::new(b"k".to_vec()));
    assert!(!one.is_empty() && one.len() == 1);
}

#[test]
fn the_shortest_lease_a_one_byte_secret_opens() {
    let mut f = Fixture::new(31);
    let recipient = recipient_public_key(&f.node);
    let bytes = seal_lease(&f.scope, b"x", &f.edge, &recipient, &mut f.rng)
        .expect("a one-byte secret seals")
        .to_bytes();
    let secret = f.open(&bytes).expect("and opens");
    assert_eq!(secret.expose_secret(), b"x");
}

#[test]
fn another_format_version_is_unsupported() {
    let mut f = Fixture::new(30);
    let bytes = f.seal();
    for version in [0u8, 2, 0xff] {
        let mut other = bytes.clone();
        other[0] = version;
        assert_rejected(f.open(&other), RejectionReason::UnsupportedVersion);
    }
}

#[test]
fn rejection_labels_are_closed_and_distinct() {
    let all = [
        RejectionReason::Revoked,
        RejectionReason::Disabled,
        RejectionReason::Expired,
        RejectionReason::NotYetValid,
        RejectionReason::StaleRevision,
        RejectionReason::Replayed,
        RejectionReason::ReplayCacheFull,
        RejectionReason::WrongRecipient,
        RejectionReason::Tampered,
        RejectionReason::BadSignature,
        RejectionReason::BindingMismatch {
            field: BindingField::Node,
        },
        RejectionReason::Malformed,
        RejectionReason::UnsupportedVersion,
    ];
    let labels: std::collections::BTreeSet<_> = all.iter().map(|r| r.as_str()).collect();
    assert_eq!(labels.len(), all.len());
    assert!(
        labels
            .iter()
            .all(|l| l.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'))
    );
    let fields: std::collections::BTreeSet<_> =
        BindingField::ALL.iter().map(|f| f.as_str()).collect();
    assert_eq!(fields.len(), BindingField::ALL.len());
    assert_eq!(
        RejectionReason::BindingMismatch {
            field: BindingField::Slot
        }
        .to_string(),
        "binding_mismatch(slot)"
    );
}

// --- The Edge refuses to seal what the Node would refuse ------------------

#[test]
fn sealing_refuses_bad_inputs() {
    let mut f = Fixture::new(31);
    let recipient = recipient_public_key(&f.node);
    let mut seal = |scope: &LeaseScope, secret: &[u8]| {
        seal_lease(scope, secret, &f.edge, &recipient, &mut f.rng).err()
    };

    assert_eq!(seal(&f.scope, b""), Some(SealError::EmptySecret));
    let too_big = vec![1u8; MAX_SECRET_BYTES + 1];
    assert_eq!(
        seal(&f.scope, &too_big),
        Some(SealError::SecretTooLarge {
            len: MAX_SECRET_BYTES + 1
        })
    );

    let mut scope = f.scope.clone();
    scope.expires_at_unix_ms = scope.issued_at_unix_ms;
    assert_eq!(seal(&scope, SECRET), Some(SealError::InvalidLifetime));
    scope.expires_at_unix_ms = scope.issued_at_unix_ms - 1;
    assert_eq!(seal(&scope, SECRET), Some(SealError::InvalidLifetime));
    scope.expires_at_unix_ms = scope.issued_at_unix_ms + MAX_LEASE_LIFETIME_MS + 1;
    assert_eq!(seal(&scope, SECRET), Some(SealError::InvalidLifetime));
    scope.expires_at_unix_ms = scope.issued_at_unix_ms + MAX_LEASE_LIFETIME_MS;
    assert_eq!(seal(&scope, SECRET), None);

    let mut scope = f.scope.clone();
    scope.principal = "p".repeat(MAX_SCOPE_BYTES);
    assert!(matches!(
        seal(&scope, SECRET),
        Some(SealError::ScopeTooLarge { .. })
    ));
}

#[test]
fn sealing_to_a_low_order_key_is_refused() {
    let mut f = Fixture::new(32);
    let identity = x25519_dalek::PublicKey::from([0u8; 32]);
    let result = seal_lease(&f.scope, SECRET, &f.edge, &identity, &mut f.rng);
    assert_eq!(result.err(), Some(SealError::LowOrderRecipientKey));
}

#[test]
fn seal_errors_never_carry_the_secret() {
    let mut f = Fixture::new(33);
    let recipient = recipient_public_key(&f.node);
    let mut long_secret = SECRET.to_vec();
    long_secret.resize(MAX_SECRET_BYTES + 1, b'x');
    let err =
        seal_lease(&f.scope, &long_secret, &f.edge, &recipient, &mut f.rng).expect_err("too large");
    assert!(!format!("{err} {err:?}").contains("sk-test"));
}

// --- Any single-bit change anywhere is refused -----------------------------

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn any_single_bit_flip_anywhere_is_refused(seed in any::<u64>(), bit in any::<prop::sample::Index>()) {
        let mut f = Fixture::new(seed);
        let bytes = f.seal();
        let flipped = flip_bit(&bytes, bit.index(bytes.len() * 8));
        let mut replay = ReplayCache::new();
        let result = f.open_at(&flipped, NOW_MS, &mut replay);
        prop_assert!(result.is_err(), "a flipped lease opened");
        // The refused copy consumed nothing: the genuine lease still opens.
        prop_assert!(replay.is_empty());
        let genuine = f.open_at(&bytes, NOW_MS, &mut replay).map(|s| s.expose_secret() == SECRET);
        prop_assert_eq!(genuine, Ok(true));
    }
}
