//! Sequence numbers per source (instance, dp rank): gap detection and resync.
//!
//! A source's numbers are gap-free and non-decreasing: each publication unit (a kvpool event,
//! a vLLM batch) takes the previous number plus one, and the events of one unit share it.
//! For a source whose last applied number is `last`, an event numbered `s` is:
//! - `s < last`: a duplicate (a replay overlapping what was applied): skipped;
//! - `s == last`: applied (more of the last unit, or a redelivery of it: set and clear are
//!   idempotent, so applying a unit again leaves the state it left), and `last` stays;
//! - `s == last + 1`: applied, `last = s`, and a stall ends;
//! - `s > last + 1`: a gap. The source stalls: this event and every later one past `last` are
//!   dropped until an event numbered `last + 1` comes (the consumer replays from there out of
//!   the publisher's buffer), or until [`crate::KVIndex::resync`] drops the source's entries
//!   and its number, when the buffer no longer reaches back that far.
//!
//! Only `last + 1` ends a stall: an event numbered `last` during a stall is applied as above
//! (it is older than the hole, so the state stays the one after unit `last`) but the hole is
//! still there, so the source stays stalled and the gap is not reported again.
//!
//! The first event of a source (or the first after a resync) sets `last`: an index that joins
//! a stream late starts from what it sees. A stalled source keeps its entries (a router may
//! still use them, knowing they may be stale: see [`SourceState::stalled`]).

use std::collections::HashMap;

use crate::index::location::FixedState;

/// The state of one source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SourceState {
    /// The serving instance.
    pub instance: u64,
    /// The data-parallel rank inside the instance.
    pub dp_rank: u32,
    /// The last applied number.
    pub last: u64,
    /// The number of the event that opened a gap, while the source is stalled.
    pub stalled: Option<u64>,
}

/// A gap found by an `apply`: the source's next number should have been `expected`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gap {
    /// The serving instance.
    pub instance: u64,
    /// The data-parallel rank inside the instance.
    pub dp_rank: u32,
    /// The sequence number the source was expected to send next.
    pub expected: u64,
    /// The sequence number it sent.
    pub got: u64,
}

/// What the sequence check says of one event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    Apply,
    Duplicate,
    /// Dropped; `Some` when this event opened the gap.
    Dropped(Option<Gap>),
}

/// One source's state, read once for a run of its events in a batch ([`Sources::open`]) and
/// written back at the run's end ([`Sources::close`]): one map look-up per run, not per event.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Cursor {
    pub(crate) dp_rank: u32,
    instance: u64,
    /// (last, stalled), as the map keeps them.
    state: (u64, Option<u64>),
    /// The map's value when opened (`None`: a new source).
    before: Option<(u64, Option<u64>)>,
}

impl Cursor {
    /// The verdict on the source's event numbered `sequence` (see the module doc); records it.
    #[inline]
    pub(crate) fn admit(&mut self, sequence: u64) -> Verdict {
        let (last, stalled) = self.state;
        if sequence < last {
            Verdict::Duplicate
        } else if sequence == last {
            // Older than any hole: applied, and a stall stays (the hole is still there).
            Verdict::Apply
        } else if sequence == last + 1 {
            self.state = (sequence, None);
            Verdict::Apply
        } else {
            let gap = stalled.is_none().then_some(Gap {
                instance: self.instance,
                dp_rank: self.dp_rank,
                expected: last + 1,
                got: sequence,
            });
            self.state.1 = Some(stalled.unwrap_or(sequence));
            Verdict::Dropped(gap)
        }
    }
}

/// Every source's last number.
#[derive(Clone, Debug, Default)]
pub(crate) struct Sources {
    map: HashMap<(u64, u32), (u64, Option<u64>), FixedState>,
}

impl Sources {
    #[cfg(all(test, not(kvpool_loom)))]
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// The verdict on an event numbered `sequence` of (`instance`, `dp_rank`); records it.
    #[cfg(all(test, not(kvpool_loom)))]
    pub(crate) fn admit(&mut self, instance: u64, dp_rank: u32, sequence: u64) -> Verdict {
        self.admit_tracked(instance, dp_rank, sequence).0
    }

    /// [`Sources::admit`], with the source's new state if it changed.
    #[cfg(all(test, not(kvpool_loom)))]
    pub(crate) fn admit_tracked(
        &mut self,
        instance: u64,
        dp_rank: u32,
        sequence: u64,
    ) -> (Verdict, Option<SourceState>) {
        let mut cursor = self.open(instance, dp_rank, sequence);
        let verdict = cursor.admit(sequence);
        (verdict, self.close(cursor))
    }

    /// Whether an event numbered `sequence` of (`instance`, `dp_rank`) would be applied now
    /// (not a duplicate, not dropped by a gap or a stall); records nothing.
    pub(crate) fn admits(&self, instance: u64, dp_rank: u32, sequence: u64) -> bool {
        let mut cursor = self.open(instance, dp_rank, sequence);
        cursor.admit(sequence) == Verdict::Apply
    }

    /// A cursor on (`instance`, `dp_rank`) for a run of its events, `sequence` being the
    /// first one's number (a new source starts from it).
    #[inline]
    pub(crate) fn open(&self, instance: u64, dp_rank: u32, sequence: u64) -> Cursor {
        let before = self.map.get(&(instance, dp_rank)).copied();
        Cursor {
            instance,
            dp_rank,
            state: before.unwrap_or((sequence, None)),
            before,
        }
    }

    /// Writes `cursor`'s state back; returns it if it changed (or the source is new).
    #[inline]
    pub(crate) fn close(&mut self, cursor: Cursor) -> Option<SourceState> {
        if cursor.before == Some(cursor.state) {
            return None;
        }
        self.map
            .insert((cursor.instance, cursor.dp_rank), cursor.state);
        Some(SourceState {
            instance: cursor.instance,
            dp_rank: cursor.dp_rank,
            last: cursor.state.0,
            stalled: cursor.state.1,
        })
    }

    /// Forgets the number of (`instance`, `dp_rank`), or of every rank of `instance`.
    pub(crate) fn forget(&mut self, instance: u64, dp_rank: Option<u32>) {
        self.map
            .retain(|&(i, d), _| i != instance || dp_rank.is_some_and(|r| r != d));
    }

    /// Every source, sorted by (instance, dp rank).
    pub(crate) fn list(&self) -> Vec<SourceState> {
        let mut out: Vec<SourceState> = self
            .map
            .iter()
            .map(|(&(instance, dp_rank), &(last, stalled))| SourceState {
                instance,
                dp_rank,
                last,
                stalled,
            })
            .collect();
        out.sort_by_key(|s| (s.instance, s.dp_rank));
        out
    }

    /// Sets one source's state (from a dump, or replaying a write).
    pub(crate) fn restore(&mut self, state: SourceState) {
        self.map
            .insert((state.instance, state.dp_rank), (state.last, state.stalled));
    }
}

#[cfg(all(test, not(kvpool_loom)))]
mod tests {
    use super::*;

    #[test]
    fn gaps_stall_until_the_replay_fills_them() {
        let mut s = Sources::default();
        assert_eq!(
            s.admit(1, 0, 5),
            Verdict::Apply,
            "the first number sets the base"
        );
        assert_eq!(
            s.admit(1, 0, 5),
            Verdict::Apply,
            "a unit's events share a number"
        );
        assert_eq!(s.admit(1, 0, 6), Verdict::Apply);
        assert_eq!(s.admit(1, 0, 4), Verdict::Duplicate);
        let gap = Gap {
            instance: 1,
            dp_rank: 0,
            expected: 7,
            got: 9,
        };
        assert_eq!(s.admit(1, 0, 9), Verdict::Dropped(Some(gap)));
        assert_eq!(s.admit(1, 0, 10), Verdict::Dropped(None), "reported once");
        assert_eq!(s.list()[0].stalled, Some(9));
        assert_eq!(
            s.admit(1, 1, 0),
            Verdict::Apply,
            "ranks are separate sources"
        );
        // C3, G4: a redelivery of the last unit during the stall is applied, but only the
        // missing number ends the stall (no second report of the same gap either).
        assert!(s.admits(1, 0, 6) && !s.admits(1, 0, 4) && !s.admits(1, 0, 11));
        assert_eq!(s.admit(1, 0, 6), Verdict::Apply, "the last unit again");
        assert_eq!(s.list()[0].stalled, Some(9), "the hole is still there");
        assert_eq!(
            s.admit(1, 0, 11),
            Verdict::Dropped(None),
            "the gap is not reported again"
        );
        assert!(s.admits(1, 0, 7));
        assert_eq!(s.admit(1, 0, 7), Verdict::Apply, "the replay resumes");
        assert_eq!(s.list()[0].stalled, None);
        s.forget(1, Some(0));
        assert_eq!(s.len(), 1);
        assert_eq!(
            s.admit(1, 0, 100),
            Verdict::Apply,
            "a resynced source restarts"
        );
        s.forget(1, None);
        assert_eq!(s.len(), 0);
    }
}
