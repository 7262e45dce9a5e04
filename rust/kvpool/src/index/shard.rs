//! One shard of an index: the published copy, the spare copy and the writer's links of the
//! instances the shard holds (see the module doc of `mod.rs` for the two copies).
//!
//! Invariants (checked by [`Shard::check`]): the published copy is the writer's `current`;
//! once the spare copy is levelled, both copies are equal record for record and each meets
//! [`IndexState::check`] with the writer's links.

use std::sync::Arc;

use arc_swap::{ArcSwap, Guard};
use parking_lot::Mutex;

use super::dump;
use super::state::{IndexState, Journal};
use super::tree::Links;
use crate::error::{ensure_invariant, KvPoolError, Result};

/// Spins (yielding) this many times for a reader to leave the unpublished copy before the
/// writer copies the published one instead.
const SPARE_SPINS: usize = 64;

struct Writer {
    /// The unpublished copy: equal to the published one once `journal` is replayed on it.
    spare: Arc<IndexState>,
    /// The published copy (the writer's own reference: it reads it to level the spare one).
    current: Arc<IndexState>,
    /// The tree's links (parents, children, LRU, free ids): the writer's alone, one for both
    /// copies, always those of the published copy.
    links: Links,
    /// The last write's journal (replayed on `spare` when `pending`, with the links' changes).
    journal: Journal,
    pending: bool,
    /// Writes that found the spare copy held by a reader and copied the published one.
    copies: u64,
}

pub(crate) struct Shard {
    published: ArcSwap<IndexState>,
    writer: Mutex<Writer>,
}

impl Shard {
    pub(crate) fn new(state: IndexState, links: Links) -> Self {
        let spare = state.clone(); // the same table: both copies are equal
        let current = Arc::new(state);
        Self {
            published: ArcSwap::new(Arc::clone(&current)),
            writer: Mutex::new(Writer {
                current,
                spare: Arc::new(spare),
                links,
                journal: Journal::default(),
                pending: false,
                copies: 0,
            }),
        }
    }

    /// The published copy, for reads (lock-free).
    #[inline]
    pub(crate) fn load(&self) -> Guard<Arc<IndexState>> {
        self.published.load()
    }

    /// Runs one write: brings the spare copy level, applies `write` to it (recording its
    /// journal and the links' changes) and publishes it. A write validates before it changes
    /// anything, so an `Err` normally changed nothing and publishes nothing; should one have
    /// changed the copy, what it did is published with the error, so that the copies and
    /// the links stay one state.
    pub(crate) fn write<T>(
        &self,
        write: impl FnOnce(&mut IndexState, &mut Links, &mut Journal) -> Result<T>,
    ) -> Result<T> {
        let mut guard = self.writer.lock();
        let writer = &mut *guard;
        self.level_spare(writer)?;
        writer.journal.clear();
        let state = Arc::get_mut(&mut writer.spare)
            .ok_or_else(|| KvPoolError::Invariant("the spare copy is shared".into()))?;
        writer.links.begin_write();
        let result = write(state, &mut writer.links, &mut writer.journal);
        let changed = !writer.journal.steps.is_empty()
            || writer.journal.expiry_rebuilt
            || writer.links.changed() != 0;
        if result.is_ok() || changed {
            let next = Arc::clone(&writer.spare);
            // The old published copy comes back as the spare one; the writer's own
            // reference moves to the new one.
            writer.current = Arc::clone(&next);
            writer.spare = self.published.swap(next);
            writer.pending = true;
        }
        result
    }

    /// Makes the spare copy the writer's alone and equal to the published one.
    fn level_spare(&self, writer: &mut Writer) -> Result<()> {
        let mut spins = 0;
        while Arc::get_mut(&mut writer.spare).is_none() && spins < SPARE_SPINS {
            std::thread::yield_now();
            spins += 1;
        }
        if Arc::get_mut(&mut writer.spare).is_none() {
            // A reader still holds it: start from a copy of the published state, with a
            // table of its own (the old one stays as it is for the copies readers hold).
            let mut copy = IndexState::clone(&writer.current);
            copy.tree.rebuild_table(copy.tree.len() + 1);
            writer.spare = Arc::new(copy);
            writer.pending = false;
            writer.copies += 1;
            return Ok(());
        }
        if !writer.pending {
            return Ok(());
        }
        writer.pending = false;
        let state = Arc::get_mut(&mut writer.spare)
            .ok_or_else(|| KvPoolError::Invariant("the spare copy is shared".into()))?;
        let published = &writer.current;
        state.level_with(published, &writer.journal, writer.links.changes())?;
        // Neither copy holds the nodes the write deleted now (unless it made them again).
        state.tree.drop_deleted(writer.links.deleted());
        Ok(())
    }

    /// Writes that found the spare copy held by a reader and copied instead of waiting.
    pub(crate) fn spare_copies(&self) -> u64 {
        self.writer.lock().copies
    }

    /// The dump of the published state (`dump.rs`).
    pub(crate) fn dump(&self) -> Vec<u8> {
        let writer = self.writer.lock();
        dump::encode(&writer.current, &writer.links)
    }

    /// Bytes by part (see `KVIndex::heap_bytes`).
    pub(crate) fn heap_bytes(&self, out: &mut Vec<(String, usize)>) {
        let writer = self.writer.lock();
        let shared = Arc::ptr_eq(writer.current.tree.table(), writer.spare.tree.table());
        for (copy, state) in [("published", &writer.current), ("spare", &writer.spare)] {
            for (part, bytes) in state.tree.bytes() {
                if !(copy == "spare" && part == "table" && shared) {
                    out.push((format!("{copy} {part}"), bytes));
                }
            }
        }
        out.push(("links".to_string(), writer.links.bytes()));
    }

    /// Checks every invariant: each copy's, and that the two are equal once levelled.
    pub(crate) fn check(&self) -> Result<()> {
        let mut writer = self.writer.lock();
        self.level_spare(&mut writer)?;
        let spare = &writer.spare;
        let published = self.published.load();
        ensure_invariant!(
            Arc::ptr_eq(&published, &writer.current),
            "the writer's published copy is not the published one"
        );
        published.check(&writer.links)?;
        spare.check(&writer.links)?;
        spare.tree.check_same_as(&published.tree)?;
        ensure_invariant!(
            dump::encode(spare, &writer.links) == dump::encode(&published, &writer.links),
            "the two copies differ after the replay"
        );
        Ok(())
    }
}
