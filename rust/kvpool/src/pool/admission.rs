//! Admission: plan once, then allocate (R13-R15).
//!
//! [`BlockManagerPool::plan`] decides an allocation without side effects and returns it as an
//! [`AllocationPlan`]; `allocate(seq, plan)` carries it out when nothing changed since (the
//! pool's generation, the sequence object and its length, `num_tokens`), and plans again
//! otherwise. A plan is made of:
//! - a **survey**: the rank (R13) and ONE walk of the chain per tier (device, then host from
//!   block 0); the walks carry the ids they found, so allocating only retains them;
//! - a **decision**: the hit, narrowed over the rank's groups to the deepest boundary every group
//!   can serve (the R23 checkpoint trim is the linear group's limit, the window group's is the
//!   boundary whose window blocks are held); the device part alone decides whether the
//!   allocation succeeds (R14, R15: a host tier never changes the answer); a hit that continues
//!   in the host tier (and the remote tier behind it) extends it to the deepest boundary past the
//!   device hit that every group accepts and the device (and host) blocks can hold.
//!
//! Allocating follows R14's order: retain the walked blocks and take the groups' hits (pinning
//! the checkpoint), then the single block, the live slot and the new blocks; any failure gives
//! everything back. With a host part, the load is attached to the fresh table entries.

use crate::error::{ensure_arg, Result};
use crate::groups::{Group, HitQuery, QueryChain, Walk};
use crate::hash::BlockHash;
use crate::sequence::{Allocation, Sequence};
use crate::tiers::{ChainRef, HostPart, HostTier, RemoteHits};

use super::plan::{AllocationPlan, Decision, Kind, Survey, TableExtent};
use super::BlockManagerPool;
use crate::groups::{Miss, MissReason};

/// Chain walks of a pool's caches so far (debug counters; not part of `stats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DebugCounters {
    /// Walks of a chain through the device prefix caches.
    pub device_chain_walks: u64,
    /// Walks of a chain through the host prefix caches.
    pub host_chain_walks: u64,
}

impl BlockManagerPool {
    /// Chain walks of the device and host caches so far (for tests of one walk per admission).
    pub fn debug_counters(&self) -> DebugCounters {
        DebugCounters {
            device_chain_walks: self
                .ranks
                .iter()
                .filter_map(|r| r.full.cache())
                .map(|c| c.num_walks())
                .sum(),
            host_chain_walks: self.host.as_ref().map_or(0, HostTier::num_walks),
        }
    }

    /// R13: the rank a sequence without one goes to, or `None` if no rank can take a new
    /// sequence (single block, and what every group needs).
    pub(crate) fn choose_rank(&self, seq: &Sequence) -> Option<usize> {
        if let Some(rank) = seq.dp_rank().filter(|&r| r < self.ranks.len()) {
            return Some(rank);
        }
        let mut best: Option<(usize, usize)> = None;
        for (index, rank) in self.ranks.iter().enumerate() {
            if !rank.admits() {
                continue;
            }
            let available = rank.available();
            if best.is_none_or(|(_, b)| available > b) {
                best = Some((index, available));
            }
        }
        best.map(|(index, _)| index)
    }

    /// Plans `allocate(seq, num_tokens)` with no side effect of any kind (R15): `None` if it
    /// would return false. A sequence that holds blocks gets a growth plan.
    pub fn plan(
        &self,
        seq: &mut Sequence,
        num_tokens: Option<usize>,
    ) -> Result<Option<AllocationPlan>> {
        self.plan_extent(seq, num_tokens.map(TableExtent::Tokens))
    }

    /// [`Self::plan`] for a table extent (`None`: `len(seq)` tokens).
    pub fn plan_extent(
        &self,
        seq: &mut Sequence,
        extent: Option<TableExtent>,
    ) -> Result<Option<AllocationPlan>> {
        let extent = Self::validate_extent(seq, extent)?;
        if self.take_seq(seq)? {
            let n = extent.tokens(seq.len(), seq.num_computed_tokens());
            let Some(need) = self.growth(seq, n) else {
                return Ok(None);
            };
            let rank = seq.alloc().map_or(0, |a| a.rank);
            let entries = seq.blocks().len() + need;
            return Ok(Some(self.stamp(
                seq,
                extent,
                n,
                rank,
                Kind::Grow { need, entries },
            )));
        }
        let bs = self.config.block_size;
        Ok(self
            .plan_admission(seq, extent, None, false)
            .map(|(rank, survey, decision)| {
                let n = extent.tokens(seq.len(), decision.hit * bs);
                self.stamp(seq, extent, n, rank, Kind::Admit(survey, decision))
            }))
    }

    /// `extent` checked against `seq` (R14, R29): `num_tokens` in `1..=len(seq)`,
    /// `num_new_tokens` at least 1; `None` is `len(seq)`.
    fn validate_extent(seq: &Sequence, extent: Option<TableExtent>) -> Result<TableExtent> {
        match extent {
            Some(TableExtent::NewTokens(n)) => {
                ensure_arg!(n >= 1, "num_new_tokens", "must be at least 1, got {n}");
                ensure_arg!(
                    !seq.is_empty(),
                    "num_new_tokens",
                    "sequence {} has no tokens",
                    seq.seq_id()
                );
                Ok(TableExtent::NewTokens(n))
            }
            Some(TableExtent::Tokens(n)) => {
                Self::validate_num_tokens(seq, Some(n)).map(TableExtent::Tokens)
            }
            None => Self::validate_num_tokens(seq, None).map(TableExtent::Tokens),
        }
    }

    fn stamp(
        &self,
        seq: &Sequence,
        extent: TableExtent,
        num_tokens: usize,
        rank: usize,
        kind: Kind,
    ) -> AllocationPlan {
        AllocationPlan {
            pool: self.id,
            generation: self.generation,
            seq: seq.uid(),
            seq_len: seq.len(),
            extent,
            num_tokens,
            block_size: self.config.block_size,
            rank,
            kind,
        }
    }

    /// Whether `plan` was made by this pool for this very sequence and call, and nothing
    /// changed since. A call for the tokens a `num_new_tokens` plan resolved to is the same call
    /// (it makes the same decision).
    fn is_current(&self, plan: &AllocationPlan, seq: &Sequence, extent: TableExtent) -> bool {
        plan.pool == self.id
            && plan.generation == self.generation
            && plan.seq == seq.uid()
            && plan.seq_len == seq.len()
            && (plan.extent == extent || extent == TableExtent::Tokens(plan.num_tokens))
    }

    /// R14 with a plan: carries out `plan` if it is current, else plans again; `remote` names
    /// the chain blocks the remote tier holds (the answer to [`Self::remote_query`]), which only
    /// extend the hit. On a sequence that holds blocks, grows its tables.
    pub fn allocate_planned(
        &mut self,
        seq: &mut Sequence,
        num_tokens: Option<usize>,
        plan: Option<&AllocationPlan>,
        remote: Option<RemoteHits>,
    ) -> Result<bool> {
        self.allocate_extent(seq, num_tokens.map(TableExtent::Tokens), plan, remote)
    }

    /// [`Self::allocate_planned`] for a table extent (`None`: `len(seq)` tokens);
    /// `TableExtent::NewTokens` sizes a first chunk past the hit in one walk.
    pub fn allocate_extent(
        &mut self,
        seq: &mut Sequence,
        extent: Option<TableExtent>,
        plan: Option<&AllocationPlan>,
        remote: Option<RemoteHits>,
    ) -> Result<bool> {
        let extent = Self::validate_extent(seq, extent)?;
        let owned = self.take_seq(seq)?;
        self.retry_pending()?;
        let current = plan.filter(|p| self.is_current(p, seq, extent));
        self.generation += 1;
        if owned {
            let n = extent.tokens(seq.len(), seq.num_computed_tokens());
            return Ok(self.grow(seq, n));
        }
        if let Some(AllocationPlan {
            rank,
            extent,
            kind: Kind::Admit(survey, decision),
            ..
        }) = current
        {
            if remote.is_none() {
                return Ok(self.admit(seq, *rank, survey, decision));
            }
            // The remote answer extends the decision; the walks stand.
            return Ok(
                match self.decide(seq, *rank, survey, *extent, remote, false) {
                    Some(decision) => self.admit(seq, *rank, survey, &decision),
                    None => false,
                },
            );
        }
        Ok(match self.plan_admission(seq, extent, remote, false) {
            Some((rank, survey, decision)) => self.admit(seq, rank, &survey, &decision),
            None => false,
        })
    }

    /// xLLM's `allocate_shared(seq)`: the trimmed device hit only, with the single block and
    /// the live slot and no new blocks; `allocate` then grows the table. A sequence that holds
    /// blocks is a `ValueError`-style error; false (nothing changed) if the rank has no room.
    pub(crate) fn allocate_shared_prefix(&mut self, seq: &mut Sequence) -> Result<bool> {
        ensure_arg!(
            !self.take_seq(seq)?,
            "seq",
            "sequence {} already holds blocks (allocate grows its table)",
            seq.seq_id()
        );
        ensure_arg!(
            !seq.is_empty(),
            "seq",
            "sequence {} has no tokens",
            seq.seq_id()
        );
        self.generation += 1;
        let extent = TableExtent::Tokens(seq.len());
        Ok(match self.plan_admission(seq, extent, None, true) {
            Some((rank, survey, decision)) => self.admit(seq, rank, &survey, &decision),
            None => false,
        })
    }

    /// Survey and decision of a first allocation; `shared`: the hit only (`allocate_shared`).
    fn plan_admission(
        &self,
        seq: &mut Sequence,
        extent: TableExtent,
        remote: Option<RemoteHits>,
        shared: bool,
    ) -> Option<(usize, Survey, Decision)> {
        let rank = self.choose_rank(seq)?;
        if !self.ranks[rank].admits() {
            return None;
        }
        let survey = self.survey(seq, rank);
        let decision = self.decide(seq, rank, &survey, extent, remote, shared)?;
        Some((rank, survey, decision))
    }

    /// One walk of the chain per tier (the sequence memoizes its hashes).
    fn survey(&self, seq: &mut Sequence, rank: usize) -> Survey {
        let bs = self.config.block_size;
        let full = &self.ranks[rank].full;
        let query = match full.cache() {
            Some(_) => (seq.len() - 1) / bs, // R8: leave at least one token to compute
            None => 0,
        };
        if query > 0 {
            seq.ensure_hashes(&full.hasher(), bs, query * bs);
        }
        let hashes = seq.hashes(query);
        let device = full.walk(hashes, seq.tokens(), seq.extra_key(), query);
        let host = match &self.host {
            Some(host) if device.len() < query => {
                Some(host.walk(rank, hashes, seq.tokens(), seq.extra_key(), query))
            }
            _ => None,
        };
        Survey {
            query,
            device,
            host,
        }
    }

    /// The decision of a first allocation on `rank` from its survey, with no side effect.
    fn decide(
        &self,
        seq: &Sequence,
        rank: usize,
        survey: &Survey,
        extent: TableExtent,
        remote: Option<RemoteHits>,
        shared: bool,
    ) -> Option<Decision> {
        let bs = self.config.block_size;
        // Table entries for a hit of `k` blocks (`num_new_tokens` counts past the hit).
        let entries_at = |k: usize| self.blocks_for(extent.tokens(seq.len(), k * bs));
        let r = &self.ranks[rank];
        let hashes = seq.hashes(survey.query);
        let tokens = seq.tokens();
        let chain = self.query_chain(rank, survey, (hashes, tokens, seq.extra_key()));
        // The fold of the groups' limits, until it no longer moves.
        let narrow = |limit: usize| {
            let mut k = limit;
            loop {
                let before = k;
                for group in &r.groups {
                    k = group.hit_limit(&chain, k);
                }
                if k == before || k == 0 {
                    return k;
                }
            }
        };
        // The full-attention group's store also gives the shared groups their blocks.
        let fits = |k: usize, device_hit: usize, entries: usize| {
            let shared: usize = r.groups.iter().map(|g| g.demand(&chain, k, entries)).sum();
            let spare: usize = r.groups.iter().map(|g| g.spare_after(&chain, k)).sum();
            r.full
                .fits(&survey.device, device_hit, entries, shared, spare)
                && r.groups.iter().all(|g| g.fits(&chain, k, entries))
        };
        let linear = r.groups.iter().any(|g| matches!(g, Group::Linear(_)));
        let restore = |k: usize| (linear && k > 0).then(|| hashes[k - 1]);
        // Why no hit past `hit` when the full-attention chain reached `reach`.
        let miss = |hit: usize, reach: usize| -> Option<Miss> {
            let cache = r.full.cache()?;
            if survey.query == 0 {
                return Some(Miss {
                    group: 0,
                    reason: MissReason::ShorterThanBlock,
                });
            }
            if hit >= survey.query {
                return None;
            }
            if hit < reach {
                return r.groups.iter().enumerate().find_map(|(i, g)| {
                    (g.hit_limit(&chain, reach) < reach).then(|| Miss {
                        group: i + 1,
                        reason: g.miss_reason(),
                    })
                });
            }
            let reason = match cache.was_evicted(hashes[reach]) {
                true => MissReason::Evicted,
                false => MissReason::NoSharedPrefix,
            };
            Some(Miss { group: 0, reason })
        };
        let d = survey.device.len();
        let kd = narrow(d);
        let entries = if shared { kd } else { entries_at(kd) };
        if !fits(kd, kd, entries) {
            return None;
        }
        let device_only = Decision {
            hit: kd,
            device_hit: kd,
            host: None,
            entries,
            restore: restore(kd),
            miss: miss(kd, d.max(survey.host.as_ref().map_or(0, Walk::len))),
        };
        let (Some(host), Some(walk), false) = (&self.host, &survey.host, shared) else {
            return Some(device_only);
        };
        // The tier extension: the deepest boundary past the device hit that every group
        // accepts and the device and host blocks can hold.
        let h = walk.len();
        let reach = h.max(d);
        // Remote hits only where every group is full attention (tiers/remote.rs).
        let remote = remote.filter(|_| r.groups.is_empty());
        let end = HostTier::remote_end(remote, reach, survey.query);
        let mut k = if end > d { narrow(end) } else { 0 };
        while k > d {
            let table = entries_at(k).max(k);
            let host_end = h.min(k);
            let pinned = if host_end > d { host_end } else { 0 };
            let staging = k - host_end.max(d);
            if fits(k, d, table) && host.staging_fits(rank, walk, pinned, staging) {
                return Some(Decision {
                    hit: k,
                    device_hit: d,
                    host: Some(HostPart {
                        walk: walk.clone(),
                        host_end,
                        end: k,
                    }),
                    entries: table,
                    restore: restore(k),
                    miss: miss(k, reach),
                });
            }
            k = narrow(k - 1);
        }
        Some(device_only)
    }

    /// The chain of a query as the groups verify it: its hashes and tokens with the ids the
    /// survey's walks verified in the device cache and the host cache of `rank` (R7).
    fn query_chain<'a>(
        &'a self,
        rank: usize,
        survey: &'a Survey,
        chain: (&'a [BlockHash], &'a [u32], Option<&'a [u8]>),
    ) -> QueryChain<'a> {
        let device = self.ranks[rank]
            .full
            .cache()
            .map(|c| (c, survey.device.ids.as_slice()));
        let host = self
            .host
            .as_ref()
            .and_then(|h| h.cache(rank))
            .zip(survey.host.as_ref())
            .map(|(c, walk)| (c, walk.ids.as_slice()));
        QueryChain::new(chain, device, host)
    }

    /// Carries out a decision (R14's order; all-or-nothing). False only if something the plan
    /// found vanished meanwhile (a window block released by a handle drop elsewhere).
    fn admit(
        &mut self,
        seq: &mut Sequence,
        rank: usize,
        survey: &Survey,
        decision: &Decision,
    ) -> bool {
        let bs = self.config.block_size;
        let Self {
            ranks,
            ledger,
            host,
            id,
            ..
        } = self;
        let r = &mut ranks[rank];
        let hashes = seq.hashes(survey.query);
        let tokens = seq.tokens();
        let mut blocks = Vec::with_capacity(decision.entries.max(decision.device_hit));
        // Match and pin first (R14), then the single block, the live slot and new blocks.
        r.full
            .take_hit(&survey.device, decision.device_hit, &mut blocks);
        let mut tables = Vec::with_capacity(r.groups.len());
        let mut ok = true;
        {
            // The walks' ids are still entries: nothing but retains ran since the plan (R7).
            let host_walk = host
                .as_ref()
                .and_then(|h| h.cache(rank))
                .zip(survey.host.as_ref())
                .map(|(c, walk)| (c, walk.ids.as_slice()));
            let query = HitQuery {
                chain: (hashes, tokens, seq.extra_key()),
                device_ids: survey.device.ids.as_slice(),
                host: host_walk,
            };
            for group in &mut r.groups {
                match group.take_hit(&mut r.full, &query, decision.hit) {
                    Some(table) => tables.push(table),
                    None => {
                        ok = false;
                        break;
                    }
                }
            }
        }
        let single = if ok { r.single.allocate_one() } else { None };
        ok = single.is_some();
        if let Some(cache) = r.full.cache() {
            let clock = cache.clock();
            r.groups.iter_mut().for_each(|g| g.set_clock(clock));
        }
        for (group, table) in r.groups.iter_mut().zip(tables.iter_mut()) {
            ok = ok && group.take_slot(&mut r.full, table);
        }
        let need = decision.entries.saturating_sub(blocks.len());
        if ok {
            r.make_room(&tables, decision.entries, need);
        }
        ok = ok && r.full.grow(&mut blocks, need);
        for (group, table) in r.groups.iter_mut().zip(tables.iter_mut()) {
            ok = ok && group.grow(&mut r.full, table, decision.entries);
        }
        let Some(single) = single.filter(|_| ok) else {
            for (group, table) in r.groups.iter_mut().zip(tables) {
                group.undo(table);
            }
            drop(blocks);
            r.full.drain();
            return false; // unreachable single-threaded: the plan saw every resource
        };
        r.query_tokens += (survey.query * bs) as u64;
        r.hit_tokens += (decision.device_hit * bs) as u64;
        if let Some(miss) = decision.miss {
            r.misses[miss.reason.index()] += 1;
        }
        for (group, table) in r.groups.iter_mut().zip(tables.iter_mut()) {
            group.admitted(table, ledger);
        }
        let mut alloc = Allocation {
            owner: *id,
            rank,
            block_size: bs,
            blocks,
            single,
            groups: tables,
            published: decision.device_hit,
            published_epoch: r.full.cache().map_or(0, |c| c.epoch()),
            host_load: None,
        };
        if let Some(host) = host.as_mut() {
            if survey.host.is_some() {
                host.record_query(rank, survey.query - survey.device.len());
            }
            if let Some(part) = &decision.host {
                let chain = ChainRef {
                    hashes,
                    tokens,
                    extra_key: seq.extra_key_arc(),
                };
                alloc.host_load =
                    host.attach(rank, part, decision.device_hit, chain, &alloc.blocks);
            }
        }
        seq.attach(alloc, decision.device_hit * bs);
        self.collect_events(rank);
        true
    }
}
