//! Decode-time caps on the lists a peer sends (R-LIM-3).
//!
//! A frame's byte length is bounded by the decoder, but decoding multiplies
//! memory: a million empty headers fit in a few MiB of postcard and cost
//! far more as `Vec<(String, String)>`. These deserializers refuse a list
//! longer than its cap before allocating it (postcard announces the length
//! first), and an item over its size cap as soon as it is decoded.

use std::fmt;
use std::marker::PhantomData;

use serde::de::{Deserialize, Deserializer, Error as _, SeqAccess, Visitor};

use crate::{
    Header, MAX_CAPABILITY_TARGETS, MAX_HEADER_BYTES, MAX_HEADERS, MAX_MODEL_NAME_BYTES,
    MAX_MODELS_PER_TARGET, MAX_OFFERED_PROVIDERS, MAX_PARKED_RUNS, MAX_PROVIDER_MESSAGE_CHARS,
    MAX_RESPONSE_ID_BYTES, MAX_TARGET_BYTES, OfferedProvider, ParkedRun, TargetHealth,
};

struct BoundedVec<T> {
    what: &'static str,
    max_len: usize,
    item_ok: fn(&T) -> Result<(), String>,
    item: PhantomData<T>,
}

impl<'de, T: Deserialize<'de>> Visitor<'de> for BoundedVec<T> {
    type Value = Vec<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "at most {} {}", self.max_len, self.what)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
        let too_many = || {
            A::Error::custom(format!(
                "more than {} {} in one message",
                self.max_len, self.what
            ))
        };
        let announced = seq.size_hint();
        if announced.is_some_and(|n| n > self.max_len) {
            return Err(too_many());
        }
        let mut out = Vec::with_capacity(announced.unwrap_or(0).min(self.max_len));
        while let Some(item) = seq.next_element::<T>()? {
            if out.len() == self.max_len {
                return Err(too_many());
            }
            (self.item_ok)(&item).map_err(A::Error::custom)?;
            out.push(item);
        }
        Ok(out)
    }
}

fn bounded<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
    what: &'static str,
    max_len: usize,
    item_ok: fn(&T) -> Result<(), String>,
) -> Result<Vec<T>, D::Error> {
    d.deserialize_seq(BoundedVec {
        what,
        max_len,
        item_ok,
        item: PhantomData,
    })
}

/// HTTP headers: at most [`MAX_HEADERS`], each name plus value at most
/// [`MAX_HEADER_BYTES`].
pub(crate) fn headers<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Header>, D::Error> {
    bounded(d, "headers", MAX_HEADERS, |(name, value): &Header| {
        if name.len() + value.len() > MAX_HEADER_BYTES {
            return Err(format!(
                "a header of {} bytes exceeds the maximum of {MAX_HEADER_BYTES}",
                name.len() + value.len()
            ));
        }
        Ok(())
    })
}

#[allow(clippy::ptr_arg)] // the item type of a `Vec<String>` visitor
fn model_ok(model: &String) -> Result<(), String> {
    if model.len() > MAX_MODEL_NAME_BYTES {
        return Err(format!(
            "a model name of {} bytes exceeds the maximum of {MAX_MODEL_NAME_BYTES}",
            model.len()
        ));
    }
    Ok(())
}

/// Model names of one target: at most [`MAX_MODELS_PER_TARGET`], each at
/// most [`MAX_MODEL_NAME_BYTES`].
pub(crate) fn models<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    bounded(d, "models", MAX_MODELS_PER_TARGET, model_ok)
}

/// Providers offered at registration: at most [`MAX_OFFERED_PROVIDERS`].
pub(crate) fn offered_providers<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Vec<OfferedProvider>, D::Error> {
    bounded(d, "offered providers", MAX_OFFERED_PROVIDERS, |_| Ok(()))
}

/// Parked runs of one registration: at most [`MAX_PARKED_RUNS`].
pub(crate) fn parked_runs<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<ParkedRun>, D::Error> {
    bounded(d, "parked runs", MAX_PARKED_RUNS, |_| Ok(()))
}

/// A string of at most `max` bytes, refused while decoding.
fn bounded_string<'de, D: Deserializer<'de>>(
    d: D,
    what: &'static str,
    max: usize,
) -> Result<String, D::Error> {
    let s = String::deserialize(d)?;
    if s.len() > max {
        return Err(serde::de::Error::custom(format!(
            "a {what} of {} bytes exceeds the maximum of {max}",
            s.len()
        )));
    }
    Ok(s)
}

/// A response id: at most [`MAX_RESPONSE_ID_BYTES`].
pub(crate) fn response_id<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    bounded_string(d, "response id", MAX_RESPONSE_ID_BYTES)
}

/// A provider's error message: at most [`MAX_PROVIDER_MESSAGE_CHARS`]
/// characters of at most four bytes each.
pub(crate) fn provider_message<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<String>, D::Error> {
    let max = MAX_PROVIDER_MESSAGE_CHARS * 4;
    match Option::<String>::deserialize(d)? {
        Some(s) if s.len() > max => Err(serde::de::Error::custom(format!(
            "a provider message of {} bytes exceeds the maximum of {max}",
            s.len()
        ))),
        other => Ok(other),
    }
}

/// A target name: at most [`MAX_TARGET_BYTES`].
pub(crate) fn target<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    bounded_string(d, "target", MAX_TARGET_BYTES)
}

/// Targets of one capabilities report: at most [`MAX_CAPABILITY_TARGETS`].
pub(crate) fn capability_targets<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Vec<TargetHealth>, D::Error> {
    bounded(d, "targets", MAX_CAPABILITY_TARGETS, |_| Ok(()))
}

#[cfg(test)]
mod tests {
    use crate::{
        CapabilitiesReport, MAX_HEADER_BYTES, MAX_HEADERS, MAX_MODELS_PER_TARGET,
        ProviderTunnelFrame, RegisterRequest, WireError, decode, encode_frame,
    };

    fn head(headers: Vec<(String, String)>) -> ProviderTunnelFrame {
        ProviderTunnelFrame::Head {
            status: 200,
            headers,
        }
    }

    fn roundtrip<T: serde::Serialize + serde::de::DeserializeOwned>(m: &T) -> Result<T, WireError> {
        decode(&encode_frame(m).unwrap()[4..])
    }

    #[test]
    fn a_tunnel_head_is_capped_in_header_count_and_size_while_decoding() {
        // R-LIM-3: header count and size per message kind.
        let at_count = head(vec![("a".into(), String::new()); MAX_HEADERS]);
        assert_eq!(roundtrip(&at_count).unwrap(), at_count);
        let past_count = head(vec![(String::new(), String::new()); MAX_HEADERS + 1]);
        let err = roundtrip(&past_count).unwrap_err();
        assert!(matches!(err, WireError::Malformed(_)), "{err}");
        let at_size = head(vec![("n".into(), "v".repeat(MAX_HEADER_BYTES - 1))]);
        assert_eq!(roundtrip(&at_size).unwrap(), at_size);
        let past_size = head(vec![("n".into(), "v".repeat(MAX_HEADER_BYTES))]);
        assert!(roundtrip(&past_size).is_err());
    }

    #[test]
    fn a_huge_announced_header_count_is_refused_before_allocating() {
        // Variant 0 (Head), status 200 (varint), then a header count of
        // u32::MAX as a postcard varint, and nothing else.
        let payload = [0x00, 0xC8, 0x01, 0xFF, 0xFF, 0xFF, 0xFF, 0x0F];
        let err = decode::<ProviderTunnelFrame>(&payload).unwrap_err();
        assert!(matches!(err, WireError::Malformed(_)), "{err}");
    }

    #[test]
    fn model_lists_are_capped_at_registration_and_in_capabilities() {
        let models = vec!["m".to_owned(); MAX_MODELS_PER_TARGET + 1];
        let register = RegisterRequest {
            protocol_version: 1,
            node_version: "v".into(),
            providers: vec![crate::OfferedProvider {
                adapter: crate::AdapterKind::Mock,
                target: "t".into(),
                models: models.clone(),
                max_concurrent_runs: None,
            }],
            max_concurrent_runs: 1,
            recipient_public_key: None,
            parked: Vec::new(),
        };
        assert!(roundtrip(&register).is_err());
        let report = CapabilitiesReport {
            targets: vec![crate::TargetHealth {
                adapter: crate::AdapterKind::Mock,
                target: "t".into(),
                status: crate::ProviderHealth::Available,
                failure_code: None,
                models: models[1..].to_vec(),
            }],
            health_observation_seq: 1,
        };
        assert_eq!(roundtrip(&report).unwrap(), report);
        let long_name = CapabilitiesReport {
            targets: vec![crate::TargetHealth {
                models: vec!["m".repeat(crate::MAX_MODEL_NAME_BYTES + 1)],
                ..report.targets[0].clone()
            }],
            health_observation_seq: 1,
        };
        assert!(roundtrip(&long_name).is_err());
    }

    #[test]
    fn parked_run_reports_are_capped_in_count_and_name_lengths() {
        let run = crate::ParkedRun {
            key: crate::RunKey {
                generation: 1,
                run_id: 1,
            },
            response_id: "resp_1".into(),
            adapter: crate::AdapterKind::Mock,
            target: "t".into(),
            first_kept_frame: 1,
            last_frame: 0,
            ended: false,
        };
        let register = |parked: Vec<crate::ParkedRun>| RegisterRequest {
            protocol_version: crate::PROTOCOL_VERSION,
            node_version: "v".into(),
            providers: Vec::new(),
            max_concurrent_runs: 1,
            recipient_public_key: None,
            parked,
        };
        let ok = register(vec![run.clone(); 3]);
        assert_eq!(roundtrip(&ok).unwrap(), ok);
        assert!(roundtrip(&register(vec![run.clone(); crate::MAX_PARKED_RUNS + 1])).is_err());
        let long_id = crate::ParkedRun {
            response_id: "r".repeat(crate::MAX_RESPONSE_ID_BYTES + 1),
            ..run.clone()
        };
        assert!(roundtrip(&register(vec![long_id])).is_err());
        let long_target = crate::ParkedRun {
            target: "t".repeat(crate::MAX_TARGET_BYTES + 1),
            ..run
        };
        assert!(roundtrip(&register(vec![long_target])).is_err());
    }
}
