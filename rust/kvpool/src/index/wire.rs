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
//!
//! Decoding is strict (the bytes come from the network): a batch and an event are maps (not
//! arrays), their keys str (not bin), a key appears once, the enums and keys are str (not
//! bin), hashes and the extra key bin (not str), lists arrays (not bin), ints ints (not
//! floats or bools), and nothing follows the batch. Any msgpack integer width is accepted
//! (the format does not fix one). So one batch has one encoding up to integer widths and
//! map order, and a producer's type slip is an error, not a guess.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

use crate::error::{KvPoolError, Result};
use crate::hash::BlockHash;
use crate::index::event::{EventKind, GroupKind, IndexEvent, Medium};

/// The wire format's version.
pub(crate) const WIRE_VERSION: u32 = 1;

#[derive(Serialize)]
struct WireBatch {
    version: u32,
    events: Vec<WireEvent>,
}

#[derive(Serialize)]
struct WireEvent {
    sequence: Option<u64>,
    kind: String,
    medium: String,
    dp_rank: u32,
    group: u32,
    group_kind: String,
    sliding_window: Option<u32>,
    block_size: u32,
    extra_key: Option<ByteBuf>,
    parent_hash: Option<ByteBuf>,
    block_hashes: Vec<ByteBuf>,
    token_ids: Option<Vec<u32>>,
}

// ------------------------------------------------------------------- strict decoding

/// A msgpack str (an enum's name); bin, even valid UTF-8, is refused.
struct Text(String);

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Text;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a str")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<Text, E> {
                Ok(Text(v.to_owned()))
            }
        }
        d.deserialize_str(V)
    }
}

/// A msgpack bin; a str is refused.
struct Bin(Vec<u8>);

impl<'de> Deserialize<'de> for Bin {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Bin;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("bin")
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> std::result::Result<Bin, E> {
                Ok(Bin(v.to_vec()))
            }
        }
        d.deserialize_bytes(V)
    }
}

/// A msgpack array; bin (which a lenient decoder reads as an array of bytes) is refused.
struct List<T>(Vec<T>);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for List<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = List<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array")
            }
            fn visit_seq<A: SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> std::result::Result<List<T>, A::Error> {
                // The length comes from the input: reserve no more than a small bound.
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
                while let Some(item) = seq.next_element()? {
                    out.push(item);
                }
                Ok(List(out))
            }
        }
        // `deserialize_any`: a bin reaches `visit_bytes` (refused), not `visit_seq`.
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// Reads the maps of a batch and of its events, strictly (see the module doc).
struct MapOf<T>(std::marker::PhantomData<T>);

/// A record read from a msgpack map of str keys, each key once.
trait Record: Sized {
    /// What the record is, for errors.
    const WHAT: &'static str;
    /// The keys it knows (at most 32); any other key is ignored.
    const FIELDS: &'static [&'static str];
    /// The keys that must appear, as a mask of `FIELDS` bits.
    const REQUIRED: u32;
    fn empty() -> Self;
    /// Reads the value of `FIELDS[field]`.
    fn field<'de, A: MapAccess<'de>>(
        &mut self,
        field: usize,
        map: &mut A,
    ) -> std::result::Result<(), A::Error>;
}

/// A map key: the index of a known field name, `None` for another str; bin is refused.
struct KeyOf(&'static [&'static str]);

impl<'de> DeserializeSeed<'de> for KeyOf {
    type Value = Option<usize>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl Visitor<'_> for KeyOf {
    type Value = Option<usize>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a str key")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<Option<usize>, E> {
        Ok(self.0.iter().position(|name| *name == v))
    }
}

impl<'de, T: Record> Visitor<'de> for MapOf<T> {
    type Value = T;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} as a map", T::WHAT)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<T, A::Error> {
        let mut record = T::empty();
        let mut seen = 0u32;
        while let Some(key) = map.next_key_seed(KeyOf(T::FIELDS))? {
            let Some(field) = key else {
                map.next_value::<IgnoredAny>()?; // a later version's field
                continue;
            };
            if seen & (1 << field) != 0 {
                let name = T::FIELDS[field];
                return Err(de::Error::custom(format!(
                    "{}: key {name:?} appears twice",
                    T::WHAT
                )));
            }
            seen |= 1 << field;
            record.field(field, &mut map)?;
        }
        let missing = T::REQUIRED & !seen;
        if missing != 0 {
            return Err(de::Error::missing_field(
                T::FIELDS[missing.trailing_zeros() as usize],
            ));
        }
        Ok(record)
    }
}

/// The value of `name`, its type error naming it.
fn value<'de, T: Deserialize<'de>, A: MapAccess<'de>>(
    map: &mut A,
    name: &str,
) -> std::result::Result<T, A::Error> {
    map.next_value()
        .map_err(|e| de::Error::custom(format!("{name}: {e}")))
}

impl<'de> Deserialize<'de> for WireBatch {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        d.deserialize_any(MapOf::<WireBatch>(std::marker::PhantomData))
    }
}

impl Record for WireBatch {
    const WHAT: &'static str = "a batch";
    const FIELDS: &'static [&'static str] = &["version", "events"];
    const REQUIRED: u32 = 0b11;
    fn empty() -> Self {
        Self {
            version: 0,
            events: Vec::new(),
        }
    }
    fn field<'de, A: MapAccess<'de>>(
        &mut self,
        field: usize,
        map: &mut A,
    ) -> std::result::Result<(), A::Error> {
        let name = Self::FIELDS[field];
        match field {
            0 => self.version = value(map, name)?,
            _ => self.events = value::<List<WireEvent>, _>(map, name)?.0,
        }
        Ok(())
    }
}

impl<'de> Deserialize<'de> for WireEvent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        d.deserialize_any(MapOf::<WireEvent>(std::marker::PhantomData))
    }
}

impl Record for WireEvent {
    const WHAT: &'static str = "an event";
    const FIELDS: &'static [&'static str] = &[
        "sequence",
        "kind",
        "medium",
        "dp_rank",
        "group",
        "group_kind",
        "sliding_window",
        "block_size",
        "extra_key",
        "parent_hash",
        "block_hashes",
        "token_ids",
    ];
    const REQUIRED: u32 = (1 << 1) | (1 << 7); // kind, block_size
    fn empty() -> Self {
        Self {
            sequence: None,
            kind: String::new(),
            medium: "device".to_owned(),
            dp_rank: 0,
            group: 0,
            group_kind: "full_attention".to_owned(),
            sliding_window: None,
            block_size: 0,
            extra_key: None,
            parent_hash: None,
            block_hashes: Vec::new(),
            token_ids: None,
        }
    }
    fn field<'de, A: MapAccess<'de>>(
        &mut self,
        field: usize,
        map: &mut A,
    ) -> std::result::Result<(), A::Error> {
        let name = Self::FIELDS[field];
        let bin = |b: Option<Bin>| b.map(|b| ByteBuf::from(b.0));
        match field {
            0 => self.sequence = value(map, name)?,
            1 => self.kind = value::<Text, _>(map, name)?.0,
            2 => self.medium = value::<Text, _>(map, name)?.0,
            3 => self.dp_rank = value(map, name)?,
            4 => self.group = value(map, name)?,
            5 => self.group_kind = value::<Text, _>(map, name)?.0,
            6 => self.sliding_window = value(map, name)?,
            7 => self.block_size = value(map, name)?,
            8 => self.extra_key = bin(value(map, name)?),
            9 => self.parent_hash = bin(value(map, name)?),
            10 => {
                let hashes: List<Bin> = value(map, name)?;
                self.block_hashes = hashes.0.into_iter().map(|b| ByteBuf::from(b.0)).collect();
            }
            _ => self.token_ids = value::<Option<List<u32>>, _>(map, name)?.map(|t| t.0),
        }
        Ok(())
    }
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
    let invalid = |e: &dyn fmt::Display| {
        KvPoolError::invalid("data", format!("not a kvpool event batch: {e}"))
    };
    let batch: WireBatch = rmp_serde::from_slice(data).map_err(|e| invalid(&e))?;
    // `from_slice` stops after the first value: what follows it is refused here.
    let end = value_end(data).unwrap_or(0);
    if end != data.len() {
        return Err(invalid(&format!(
            "{} bytes follow the batch",
            data.len() - end
        )));
    }
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

/// Where the first msgpack value of `data` ends (`None`: it does not end in `data`). A walk
/// over the markers alone, with a count of the values still to skip (no recursion).
fn value_end(data: &[u8]) -> Option<usize> {
    let int = |at: usize, n: usize| -> Option<usize> {
        let bytes = data.get(at..at.checked_add(n)?)?;
        Some(bytes.iter().fold(0usize, |v, &b| (v << 8) | usize::from(b)))
    };
    let (mut at, mut pending) = (0usize, 1usize);
    while pending > 0 {
        let marker = *data.get(at)?;
        // (header bytes, payload bytes, values inside)
        let (head, body, inner) = match marker {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (1, 0, 0),
            0x80..=0x8f => (1, 0, 2 * usize::from(marker & 0x0f)),
            0x90..=0x9f => (1, 0, usize::from(marker & 0x0f)),
            0xa0..=0xbf => (1, usize::from(marker & 0x1f), 0),
            0xc4 | 0xd9 => (2, int(at + 1, 1)?, 0),
            0xc5 | 0xda => (3, int(at + 1, 2)?, 0),
            0xc6 | 0xdb => (5, int(at + 1, 4)?, 0),
            0xc7 => (3, int(at + 1, 1)?, 0),
            0xc8 => (4, int(at + 1, 2)?, 0),
            0xc9 => (6, int(at + 1, 4)?, 0),
            0xca => (5, 0, 0),
            0xcb => (9, 0, 0),
            0xcc | 0xd0 => (2, 0, 0),
            0xcd | 0xd1 => (3, 0, 0),
            0xce | 0xd2 => (5, 0, 0),
            0xcf | 0xd3 => (9, 0, 0),
            0xd4 => (3, 0, 0),
            0xd5 => (4, 0, 0),
            0xd6 => (6, 0, 0),
            0xd7 => (10, 0, 0),
            0xd8 => (18, 0, 0),
            0xdc => (3, 0, int(at + 1, 2)?),
            0xdd => (5, 0, int(at + 1, 4)?),
            0xde => (3, 0, 2 * int(at + 1, 2)?),
            0xdf => (5, 0, 2 * int(at + 1, 4)?),
            0xc1 => return None, // never used
        };
        at = at.checked_add(head)?.checked_add(body)?;
        pending = pending - 1 + inner;
    }
    (at <= data.len()).then_some(at)
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

    /// msgpack by hand: a str, a bin, a map or array header.
    fn text(x: &str) -> Vec<u8> {
        let mut out = vec![0xa0 | x.len() as u8];
        out.extend_from_slice(x.as_bytes());
        out
    }
    fn bin(x: &[u8]) -> Vec<u8> {
        let mut out = vec![0xc4, x.len() as u8];
        out.extend_from_slice(x);
        out
    }

    /// A batch of one event whose fields are `fields` (key bytes, value bytes).
    fn batch(fields: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
        let mut out = vec![0x82];
        out.extend(text("version"));
        out.push(0x01);
        out.extend(text("events"));
        out.push(0x91);
        out.push(0x80 | fields.len() as u8);
        for (k, v) in fields {
            out.extend_from_slice(k);
            out.extend_from_slice(v);
        }
        out
    }

    #[test]
    fn decoding_is_strict() {
        let kind = (text("kind"), text("removed"));
        let size = (text("block_size"), vec![0x04]);
        let hashes = (text("block_hashes"), [vec![0x91], bin(&[7; 16])].concat());
        let good = batch(&[kind.clone(), size.clone(), hashes.clone()]);
        let events = decode_batch(&good).unwrap();
        assert_eq!(
            events,
            vec![IndexEvent::removed(4, vec![BlockHash::from_bytes([7; 16])])]
        );
        // Unknown keys are ignored, whatever their value (a later version's fields).
        let later = (text("future"), [vec![0x92, 0xc0], bin(b"x")].concat());
        assert_eq!(
            decode_batch(&batch(&[kind.clone(), size.clone(), hashes.clone(), later])).unwrap(),
            events
        );
        let refused = |data: &[u8], what: &str| {
            let err = decode_batch(data).expect_err(what);
            assert!(
                matches!(&err, KvPoolError::InvalidArgument { name, .. } if *name == "data"),
                "{what}: {err:?}"
            );
        };
        // C4: one encoding per batch.
        refused(
            &batch(&[(bin(b"kind"), text("removed")), size.clone()]),
            "a bin key",
        );
        refused(
            &batch(&[(text("kind"), bin(b"removed")), size.clone()]),
            "a bin enum",
        );
        refused(
            &batch(&[
                kind.clone(),
                size.clone(),
                (
                    text("block_hashes"),
                    [vec![0x91], text("0123456789abcdef")].concat(),
                ),
            ]),
            "a str hash",
        );
        refused(
            &batch(&[
                kind.clone(),
                size.clone(),
                (text("parent_hash"), text("0123456789abcdef")),
            ]),
            "a str parent",
        );
        refused(
            &batch(&[
                (text("kind"), text("stored")),
                size.clone(),
                (text("token_ids"), bin(&[1, 2, 3, 4])),
            ]),
            "bin token ids",
        );
        refused(
            &batch(&[kind.clone(), size.clone(), kind.clone()]),
            "a key twice",
        );
        refused(
            &batch(&[
                kind.clone(),
                (text("block_size"), vec![0xcb, 0x40, 0x10, 0, 0, 0, 0, 0, 0]),
            ]),
            "a float",
        );
        refused(
            &batch(&[kind.clone(), size.clone(), (text("dp_rank"), vec![0xc3])]),
            "a bool",
        );
        refused(&batch(std::slice::from_ref(&kind)), "no block_size");
        refused(&batch(std::slice::from_ref(&size)), "no kind");
        refused(&[good.clone(), vec![0xc0]].concat(), "trailing bytes");
        assert_eq!(value_end(&good), Some(good.len()));
        assert_eq!(value_end(&good[..good.len() - 1]), None);
        // Every marker family: an array of nil, ints, floats, str, bin, ext and nested maps.
        let mut every = vec![0xdc, 0, 13, 0xc0, 0xcd, 1, 2, 0xd3, 0, 0, 0, 0, 0, 0, 0, 1];
        every.extend([
            0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xd9, 2, b'a', b'b', 0xc5, 0, 1, 7,
        ]);
        every.extend([
            0xd6, 1, 0, 0, 0, 0, 0xc7, 1, 5, 9, 0xde, 0, 1, 0x01, 0x91, 0x02,
        ]);
        every.extend([0xe0, 0x7f, 0xa1, b'x', 0x90]);
        assert_eq!(value_end(&every), Some(every.len()));
        assert_eq!(value_end(&[0xc1]), None);
        let mut array_event = good.clone();
        let at = 1 + text("version").len() + 1 + text("events").len() + 1;
        assert_eq!(array_event[at], 0x83);
        array_event[at] = 0x96; // the same six items as an array
        refused(&array_event, "an event as an array");
        let mut array_batch = vec![0x92, 0x01, 0x91, 0x82];
        array_batch.extend(
            [
                text("kind"),
                text("cleared"),
                text("block_size"),
                vec![0x04],
            ]
            .concat(),
        );
        refused(&array_batch, "a batch as an array");
    }
}
