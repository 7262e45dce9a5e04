//! The msgpack wire format of event batches (documented in docs/events.md).
//!
//! A batch is a map `{"version": 1, "events": [event, ...]}`; an event is a map whose keys
//! are the field names of [`IndexEvent`] (`sequence`, `kind`, `medium`, `dp_rank`, `group`,
//! `group_kind`, `sliding_window`, `block_size`, `extra_key`, `parent_hash`, `block_hashes`,
//! `token_ids`), strings for the enums (`"stored"`, `"device"`, `"full_attention"`, ...), bin
//! for hashes (16 bytes, big-endian) and the extra key. Every key but `kind` and `block_size`
//! may be left out (its default: nil, 0, "device", "full_attention", empty); unknown keys are
//! ignored, so that later versions can add fields. Decoding validates each event as `apply`
//! does and fails whole, naming the field.

use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

use crate::error::{KvPoolError, Result};
use crate::hash::BlockHash;
use crate::index::event::{EventKind, GroupKind, IndexEvent, Medium};

/// The wire format's version.
pub(crate) const WIRE_VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
struct WireBatch {
    version: u32,
    events: Vec<WireEvent>,
}

fn device() -> String {
    "device".to_owned()
}

fn full_attention() -> String {
    "full_attention".to_owned()
}

#[derive(Serialize, Deserialize)]
struct WireEvent {
    #[serde(default)]
    sequence: Option<u64>,
    kind: String,
    #[serde(default = "device")]
    medium: String,
    #[serde(default)]
    dp_rank: u32,
    #[serde(default)]
    group: u32,
    #[serde(default = "full_attention")]
    group_kind: String,
    #[serde(default)]
    sliding_window: Option<u32>,
    block_size: u32,
    #[serde(default)]
    extra_key: Option<ByteBuf>,
    #[serde(default)]
    parent_hash: Option<ByteBuf>,
    #[serde(default)]
    block_hashes: Vec<ByteBuf>,
    #[serde(default)]
    token_ids: Option<Vec<u32>>,
}

fn hash(bytes: &[u8], name: &'static str) -> Result<BlockHash> {
    let array: [u8; 16] = bytes.try_into().map_err(|_| {
        KvPoolError::invalid(name, format!("must be 16 bytes, got {}", bytes.len()))
    })?;
    Ok(BlockHash::from_bytes(array))
}

impl WireEvent {
    fn from_event(event: &IndexEvent) -> Self {
        Self {
            sequence: event.sequence,
            kind: event.kind.as_str().to_owned(),
            medium: event.medium.as_str().to_owned(),
            dp_rank: event.dp_rank,
            group: event.group,
            group_kind: event.group_kind.as_str().to_owned(),
            sliding_window: event.group_kind.window(),
            block_size: event.block_size,
            extra_key: event.extra_key.as_ref().map(|k| ByteBuf::from(k.to_vec())),
            parent_hash: event
                .parent_hash
                .map(|h| ByteBuf::from(h.to_bytes().to_vec())),
            block_hashes: event
                .block_hashes
                .iter()
                .map(|h| ByteBuf::from(h.to_bytes().to_vec()))
                .collect(),
            token_ids: event.token_ids.clone(),
        }
    }

    fn into_event(self) -> Result<IndexEvent> {
        let event = IndexEvent {
            sequence: self.sequence,
            kind: EventKind::parse(&self.kind)?,
            medium: Medium::parse(&self.medium)?,
            dp_rank: self.dp_rank,
            group: self.group,
            group_kind: GroupKind::parse(&self.group_kind, self.sliding_window)?,
            block_size: self.block_size,
            extra_key: self.extra_key.map(|k| k.into_vec().into()),
            parent_hash: self
                .parent_hash
                .map(|h| hash(&h, "parent_hash"))
                .transpose()?,
            block_hashes: self
                .block_hashes
                .iter()
                .map(|h| hash(h, "block_hashes"))
                .collect::<Result<_>>()?,
            token_ids: self.token_ids,
        };
        event.validate()?;
        Ok(event)
    }
}

/// The msgpack bytes of a batch of `events`.
pub fn encode_batch(events: &[IndexEvent]) -> Vec<u8> {
    let batch = WireBatch {
        version: WIRE_VERSION,
        events: events.iter().map(WireEvent::from_event).collect(),
    };
    // Serializing owned strings, ints and bytes into a Vec cannot fail.
    rmp_serde::to_vec_named(&batch).unwrap_or_default()
}

/// The events of a msgpack batch; `Err(InvalidArgument)` naming "data" (malformed, or another
/// version) or the offending field.
pub fn decode_batch(data: &[u8]) -> Result<Vec<IndexEvent>> {
    let batch: WireBatch = rmp_serde::from_slice(data)
        .map_err(|e| KvPoolError::invalid("data", format!("not a kvpool event batch: {e}")))?;
    if batch.version != WIRE_VERSION {
        return Err(KvPoolError::invalid(
            "data",
            format!(
                "wire version {}, this kvpool reads version {WIRE_VERSION}",
                batch.version
            ),
        ));
    }
    batch
        .events
        .into_iter()
        .map(WireEvent::into_event)
        .collect()
}

#[cfg(all(test, not(kvpool_loom)))]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_errors() {
        let mut stored = IndexEvent::stored(4, Some(BlockHash(7)), vec![BlockHash(8)])
            .with_sequence(3)
            .with_medium(Medium::Host)
            .with_dp_rank(2)
            .with_group(1, GroupKind::SlidingWindow { window: 64 });
        stored.extra_key = Some(b"salt".to_vec().into());
        stored.token_ids = Some(vec![1, 2, 3, 4]);
        let events = vec![
            stored,
            IndexEvent::removed(4, vec![BlockHash(8)]),
            IndexEvent::cleared(4).with_sequence(4),
        ];
        let bytes = encode_batch(&events);
        assert_eq!(decode_batch(&bytes).unwrap(), events);
        assert!(decode_batch(b"\x93garbage").is_err());
        assert!(decode_batch(&bytes[..bytes.len() - 3]).is_err());
        let name = |e: KvPoolError| match e {
            KvPoolError::InvalidArgument { name, .. } => name,
            other => panic!("{other:?}"),
        };
        // A hand-built map with a short hash, another with an unknown kind.
        let short = rmp_serde::to_vec_named(&WireBatch {
            version: 1,
            events: vec![WireEvent {
                block_hashes: vec![ByteBuf::from(vec![1, 2])],
                ..WireEvent::from_event(&events[1])
            }],
        })
        .unwrap();
        assert_eq!(name(decode_batch(&short).unwrap_err()), "block_hashes");
        let unknown = rmp_serde::to_vec_named(&WireBatch {
            version: 1,
            events: vec![WireEvent {
                kind: "evicted".into(),
                ..WireEvent::from_event(&events[1])
            }],
        })
        .unwrap();
        assert_eq!(name(decode_batch(&unknown).unwrap_err()), "kind");
        let future = rmp_serde::to_vec_named(&WireBatch {
            version: 2,
            events: vec![],
        })
        .unwrap();
        assert_eq!(name(decode_batch(&future).unwrap_err()), "data");
    }
}
