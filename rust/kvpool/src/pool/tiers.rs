//! The host tier's API on the pool (R26), and the remote tier's two calls: a pool without a host
//! tier has no plans to take, and refuses every plan handed back as another pool's.

use crate::chain::OwnChain;
use crate::error::{KvPoolError, Result};
use crate::manager::BlockManagerImpl;
use crate::prefix_cache::PrefixCache;
use crate::sequence::Sequence;
use crate::tiers::{
    ChainRef, HostStats, HostTier, OffloadPolicy, RemoteHits, RemoteQuery, TransferDirection,
    TransferPlan,
};

use super::{BlockManagerPool, Publish};

impl BlockManagerPool {
    /// The host block manager of `rank`, with a host tier.
    pub fn host_manager(&self, rank: usize) -> Option<&BlockManagerImpl> {
        self.host.as_ref().and_then(|h| h.manager(rank))
    }

    /// Host block ids per rank, padding included (0 without a host tier).
    pub fn host_num_blocks(&self) -> usize {
        self.host.as_ref().map_or(0, HostTier::num_blocks)
    }

    /// The offload policy of the host tier (the default without one).
    pub fn offload_policy(&self) -> OffloadPolicy {
        self.host
            .as_ref()
            .map_or_else(OffloadPolicy::default, HostTier::policy)
    }

    /// The host tier's counters per rank, with a host tier.
    pub fn host_stats(&self) -> Option<Vec<HostStats>> {
        self.host.as_ref().map(HostTier::stats)
    }

    /// Plans the offload of `seq`'s full computed blocks (before it releases them).
    pub(super) fn plan_offload(&mut self, seq: &mut Sequence) {
        let Some(policy) = self.host.as_ref().map(HostTier::policy) else {
            return;
        };
        if !self.config.enable_prefix_cache {
            return; // without the device cache the host tier stays idle
        }
        if policy == OffloadPolicy::OnEvict {
            // Publish first: evictable = cached and held only by the sequence.
            self.publish(
                seq,
                Publish::Release {
                    all_released: false,
                },
            );
        }
        let Some(alloc) = seq.alloc() else { return };
        let rank = alloc.rank;
        let bs = self.config.block_size;
        let full = (seq.computed() / bs).min(alloc.blocks.len());
        if full == 0 {
            return;
        }
        seq.ensure_hashes(&self.ranks[rank].full.hasher(), bs, full * bs);
        let (Some(host), Some(alloc)) = (self.host.as_mut(), seq.alloc()) else {
            return;
        };
        let chain = ChainRef {
            hashes: seq.hashes(full),
            tokens: seq.tokens(),
            extra_key: seq.extra_key_arc(),
        };
        // The device entries' anchors travel with the KV where groups anchor to them (R7).
        let rank_state = &mut self.ranks[rank];
        let grouped = !rank_state.groups.is_empty();
        let reach = match rank_state.full.cache() {
            Some(c) if alloc.published_epoch == c.epoch() => alloc.published,
            _ => 0,
        };
        let mut own = grouped.then(|| {
            OwnChain::new(
                chain.hashes,
                chain.tokens,
                chain.extra_key,
                &alloc.blocks,
                rank_state.full.cache_mut(),
                bs,
                reach,
            )
        });
        host.plan_offload(rank, chain, &alloc.blocks, full, own.as_mut());
    }

    fn take(&mut self, direction: TransferDirection) -> Vec<TransferPlan> {
        self.generation += 1;
        self.host
            .as_mut()
            .map_or_else(Vec::new, |h| h.take(direction))
    }

    /// The load plans made since the last take, one per rank that has any (R26). Run them before
    /// the step that needs them, then confirm with [`Self::complete_loads`].
    pub fn take_load_plans(&mut self) -> Vec<TransferPlan> {
        self.take(TransferDirection::Load)
    }

    /// The offload plans made since the last take, one per rank that has any (R26); confirm with
    /// [`Self::complete_offloads`]. Loads and offloads never share a block, so they may run in
    /// either order.
    pub fn take_offload_plans(&mut self) -> Vec<TransferPlan> {
        self.take(TransferDirection::Offload)
    }

    /// The fetch plans (remote -> host staging) made since the last take, one per rank that has
    /// any. Run them (the remote tier's `get_many` of `keys`, verified, into host ids `dst`),
    /// then report what arrived with [`Self::complete_fetches`] or [`Self::fail_fetches`]; the
    /// loads that follow are taken with [`Self::take_load_plans`].
    pub fn take_fetch_plans(&mut self) -> Vec<TransferPlan> {
        self.take(TransferDirection::Fetch)
    }

    /// The host tier, or the error a plan of another pool gets (a pool without one made none).
    fn host_for(&mut self, plans: &[&TransferPlan]) -> Result<&mut HostTier> {
        self.generation += 1;
        match (self.host.as_mut(), plans.is_empty()) {
            (Some(host), _) => Ok(host),
            (None, true) => Err(KvPoolError::invalid("plans", "this pool has no host tier")),
            (None, false) => Err(KvPoolError::invalid(
                "plans",
                "plans[0] was made by another pool",
            )),
        }
    }

    /// After a tier completion: the released blocks of `ranks` go onto their LRU, their events
    /// into the list.
    fn settle(&mut self, ranks: &[usize]) {
        for &rank in ranks {
            self.ranks[rank].full.drain();
            self.collect_events(rank);
        }
    }

    /// Confirms that the engine ran these load plans: the loaded blocks are published in the
    /// device cache and their sequences count the loaded tokens as cached and computed (R26).
    /// Foreign, repeated or already-completed plans are an `InvalidArgument`; nothing changes
    /// then.
    pub fn complete_loads(&mut self, plans: &[&TransferPlan]) -> Result<()> {
        if plans.is_empty() {
            return Ok(());
        }
        self.host_for(plans)?
            .validate_plans(plans, TransferDirection::Load)?;
        let Self { ranks, host, .. } = self;
        let mut devices: Vec<Option<&mut PrefixCache>> =
            ranks.iter_mut().map(|r| r.full.cache_mut()).collect();
        let touched = match host.as_mut() {
            Some(host) => host.complete_loads(plans, &mut devices),
            None => Vec::new(),
        };
        self.settle(&touched);
        Ok(())
    }

    /// Confirms that the engine ran these offload plans: the host blocks are published in the
    /// host cache (matchable from now on) and the device blocks are released (R26). Foreign,
    /// repeated or already-completed plans are an `InvalidArgument`; nothing changes then.
    pub fn complete_offloads(&mut self, plans: &[&TransferPlan]) -> Result<()> {
        if plans.is_empty() {
            return Ok(());
        }
        let host = self.host_for(plans)?;
        host.validate_plans(plans, TransferDirection::Offload)?;
        let touched = host.complete_offloads(plans);
        self.settle(&touched);
        Ok(())
    }

    /// Confirms that the engine ran these fetch plans: `arrived[i][j]` says whether block `j` of
    /// `plans[i]` arrived intact in its host staging block (`None`: all did). Each record keeps
    /// the leading run of arrived blocks and becomes a load (taken by [`Self::take_load_plans`]);
    /// its sequence's ticket then promises only that much. A record with nothing left to load is
    /// dropped and its ticket marked done at the device hit: the sequence recomputes the rest.
    /// Foreign, repeated or already-completed plans, or `arrived` of the wrong shape, are an
    /// `InvalidArgument`; nothing changes then.
    pub fn complete_fetches(
        &mut self,
        plans: &[&TransferPlan],
        arrived: Option<&[Vec<bool>]>,
    ) -> Result<()> {
        if plans.is_empty() && arrived.is_none_or(|a| a.is_empty()) {
            return Ok(());
        }
        self.host_for(plans)?.complete_fetches(plans, arrived)?;
        let all: Vec<usize> = (0..self.ranks.len()).collect();
        self.settle(&all);
        Ok(())
    }

    /// [`Self::complete_fetches`] with nothing arrived: the remote tier failed (timeout, lost
    /// connection, corrupt payloads). The host parts of the records still load.
    pub fn fail_fetches(&mut self, plans: &[&TransferPlan]) -> Result<()> {
        if plans.is_empty() {
            return Ok(());
        }
        self.host_for(plans)?.fail_fetches(plans)?;
        let all: Vec<usize> = (0..self.ranks.len()).collect();
        self.settle(&all);
        Ok(())
    }

    /// Remote tier: what to ask the remote tier before allocating `seq` (a sequence that holds
    /// nothing): the chain hashes past the device and host matches of the rank it would go to,
    /// up to the R8 limit. `None` when there is nothing to ask: no host tier, the sequence holds
    /// blocks, the device cache is off, `allocate(seq, num_tokens)` would fail, the local tiers
    /// cover the whole prompt, or the rank has groups besides full attention (remote hits are
    /// not taken there: docs/host_tier.md). No side effect (the sequence caches its hashes).
    pub fn remote_query(
        &mut self,
        seq: &mut Sequence,
        num_tokens: Option<usize>,
    ) -> Result<Option<RemoteQuery>> {
        if self.host.is_none() {
            Self::validate_num_tokens(seq, num_tokens)?;
            self.take_seq(seq)?;
            return Ok(None);
        }
        let plan = self.plan(seq, num_tokens)?;
        Ok(plan.and_then(|p| self.remote_query_of(seq, &p)))
    }

    /// [`Self::remote_query`] of a plan (made by [`Self::plan`]): no walk of its own.
    pub fn remote_query_of(
        &self,
        seq: &Sequence,
        plan: &super::AllocationPlan,
    ) -> Option<RemoteQuery> {
        let (query, reach) = plan.local_reach()?;
        let rank = self.ranks.get(plan.dp_rank())?;
        let hashes = seq.hashes(query);
        if self.host.is_none()
            || !rank.groups.is_empty()
            || !plan.is_for(seq)
            || hashes.len() < query
        {
            return None;
        }
        HostTier::remote_query(hashes, reach, query)
    }

    /// Remote tier: `allocate(seq, num_tokens)` where chain blocks `remote.from..remote.to`
    /// exist on the remote tier (the answer to [`Self::remote_query`]). Exactly as
    /// all-or-nothing as `allocate` and with the same answer (R14, R15): the remote part only
    /// trims itself to the device and host blocks there are. Remote hits past the device+host
    /// reach get device blocks, host staging blocks and a fetch plan; hits that do not start at
    /// or before that reach are ignored (the tiers changed since the query).
    pub fn allocate_with_remote(
        &mut self,
        seq: &mut Sequence,
        num_tokens: Option<usize>,
        remote: Option<RemoteHits>,
    ) -> Result<bool> {
        self.allocate_planned(seq, num_tokens, None, remote)
    }
}
