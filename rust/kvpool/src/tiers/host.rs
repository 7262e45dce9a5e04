//! Loads and offloads of the host tier (R26): what an admission attaches, what a release plans,
//! the plans the engine takes and their completion.

use std::collections::HashSet;

use crate::block::Block;
use crate::chain::OwnChain;
use crate::error::{ensure_arg, Result};
use crate::groups::Walk;
use crate::hash::BlockHash;
use crate::prefix_cache::{ExtraKey, PrefixCache};
use crate::sequence::LoadTicket;
use crate::sync::Arc;

use super::{
    pending_len, HostTier, OffloadPolicy, Pending, Taken, TransferDirection, TransferPlan,
};

/// The host and remote part of an admission's hit, planned without side effects: chain
/// positions `device_hit..host_end` come from the host cache, `host_end..end` from the remote
/// tier (into host staging blocks).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HostPart {
    /// The walk of the host chain from block 0 (the host hit is its first `host_end` ids).
    pub(crate) walk: Walk,
    /// End of the host hit (`<= walk.len()`).
    pub(crate) host_end: usize,
    /// End of the whole load.
    pub(crate) end: usize,
}

/// The chain a record copies, borrowed from the sequence.
pub(crate) struct ChainRef<'a> {
    pub(crate) hashes: &'a [BlockHash],
    pub(crate) tokens: &'a [u32],
    pub(crate) extra_key: Option<&'a ExtraKey>,
}

impl HostTier {
    /// One walk of the chain in `rank`'s host cache, from block 0.
    pub(crate) fn walk(
        &self,
        rank: usize,
        hashes: &[BlockHash],
        tokens: &[u32],
        extra_key: Option<&[u8]>,
        max_blocks: usize,
    ) -> Walk {
        let mut walk = Walk::default();
        if let Some(cache) = self.ranks[rank].host.prefix_cache() {
            cache.walk(hashes, tokens, extra_key, max_blocks, &mut walk.ids);
        }
        walk
    }

    /// Whether `rank` can give `staging` fresh host blocks once the host hit `..host_end` of
    /// `walk` is pinned.
    pub(crate) fn staging_fits(
        &self,
        rank: usize,
        walk: &Walk,
        host_end: usize,
        staging: usize,
    ) -> bool {
        let pinned = walk.cache_only(host_end);
        staging <= self.ranks[rank].host.num_available().saturating_sub(pinned)
    }

    /// Counts a host lookup of `blocks` blocks past the device hit (R20's host counters).
    pub(crate) fn record_query(&mut self, rank: usize, blocks: usize) {
        self.ranks[rank].stats.query_tokens += (blocks * self.block_size) as u64;
    }

    /// Attaches the load of `part` to a sequence just allocated on `rank` with `device_hit`
    /// device blocks: `table` is its table (destinations at `device_hit..part.end`). Returns the
    /// sequence's ticket, or `None` if nothing is left to load (only if the host changed since
    /// the plan, which the pool's generation check excludes).
    pub(crate) fn attach(
        &mut self,
        rank: usize,
        part: &HostPart,
        device_hit: usize,
        chain: ChainRef<'_>,
        table: &[Block],
    ) -> Option<Arc<LoadTicket>> {
        let bs = self.block_size;
        let host = &mut self.ranks[rank];
        let mut end = part.end;
        let host_end = part.host_end.max(device_hit).min(end);
        // Host hits: pin the host chain from block 0 (so src_offset is 0).
        let mut src = Vec::with_capacity(end);
        let src_offset = if host_end > device_hit {
            if let Some(cache) = host.host.prefix_cache_mut() {
                cache.retain(&part.walk.ids[..host_end], &mut src);
            }
            0
        } else {
            host_end
        };
        // Remote hits: fresh host staging blocks.
        if end > host_end && host.host.allocate_into(end - host_end, &mut src).is_err() {
            debug_assert!(false, "the plan counted the staging blocks");
            end = host_end;
        }
        if end <= device_hit {
            drop(src);
            self.drain(rank);
            return None;
        }
        let host = &mut self.ranks[rank];
        host.stats.hit_tokens += ((host_end - device_hit) * bs) as u64;
        // The host entries' anchors go to the device entries the load makes (R7 for the groups).
        let anchors = match host.host.prefix_cache() {
            Some(cache) if host_end > device_hit => src[device_hit..host_end]
                .iter()
                .map(|b| cache.anchor_of(b.id()))
                .collect(),
            _ => Vec::new(),
        };
        let ticket = Arc::new(LoadTicket::new(end * bs));
        let record = Pending {
            hashes: chain.hashes[..end].to_vec(),
            tokens: chain.tokens[..end * bs].to_vec(),
            extra_key: chain.extra_key.cloned(),
            chain: table[..end].to_vec(),
            src,
            start: device_hit,
            src_offset,
            fetch_start: host_end,
            ticket: Some(Arc::clone(&ticket)),
            anchors,
        };
        if end > record.fetch_start {
            host.stats.remote_hit_blocks += (end - record.fetch_start) as u64;
            host.fetches.push(record);
        } else {
            host.loads.push(record);
        }
        Some(ticket)
    }

    /// Plans the offload of the first `full` blocks of `blocks` (a sequence's full computed
    /// blocks, about to be released). `own`: the chain's device entries, when the rank has
    /// groups that anchor to them (their anchors go with the KV, `prefix_cache/anchors.rs`).
    ///
    /// One offload per key (R26): the planned chain stops at a hash already being offloaded, at
    /// a hash repeated inside it, and at a hash the host cache holds for another chain (a hash
    /// collision: the host entry would stay, so the copy would be for nothing).
    pub(crate) fn plan_offload(
        &mut self,
        rank: usize,
        chain: ChainRef<'_>,
        blocks: &[Block],
        full: usize,
        own: Option<&mut OwnChain<'_>>,
    ) {
        if full == 0 {
            return;
        }
        let bs = self.block_size;
        let evictable_only = self.policy == OffloadPolicy::OnEvict;
        let hashes = &chain.hashes[..full];
        let key = chain.extra_key.map(|k| &**k);
        let host = &mut self.ranks[rank];
        let Some(cache) = host.host.prefix_cache_mut() else {
            return;
        };
        let on_host = cache.probe(hashes, chain.tokens, key, full).matched;
        let mut end = on_host;
        // Each planned hash goes into `offloading` as it is accepted (a repeat then stops).
        while end < full {
            let hash = hashes[end];
            let block = &blocks[end];
            // OnEvict: only what becomes evictable now.
            let wanted = !evictable_only || (block.is_cached() && block.ref_count() == 2);
            if !wanted || cache.contains(hash) || !host.offloading.insert(hash.0) {
                break;
            }
            end += 1;
        }
        if end == on_host {
            return;
        }
        // Pin the host prefix the chain hangs from, then take the destinations (longest prefix
        // that fits when the host is short).
        let mut dst = Vec::with_capacity(end);
        let pinned = cache.match_prefix(hashes, chain.tokens, key, on_host, &mut dst);
        debug_assert_eq!(pinned, on_host);
        let n = (end - on_host).min(host.host.num_available());
        let ok = n > 0 && host.host.allocate_into(n, &mut dst).is_ok();
        let kept = if ok { on_host + n } else { on_host };
        for hash in &hashes[kept..end] {
            host.offloading.remove(&hash.0); // accepted above, not planned after all
        }
        if !ok {
            drop(dst);
            self.drain(rank);
            return;
        }
        let end = kept;
        let anchors = match own {
            Some(own) => (on_host..end).map(|i| own.anchor(i)).collect(),
            None => Vec::new(),
        };
        host.offloads.push(Pending {
            hashes: hashes[..end].to_vec(),
            tokens: chain.tokens[..end * bs].to_vec(),
            extra_key: chain.extra_key.cloned(),
            chain: dst,
            src: blocks[..end].to_vec(),
            start: on_host,
            src_offset: 0,
            fetch_start: end,
            ticket: None,
            anchors,
        });
    }

    /// The plans made since the last take in `direction`, one per rank that has any.
    pub(crate) fn take(&mut self, direction: TransferDirection) -> Vec<TransferPlan> {
        let mut plans = Vec::new();
        for (rank, host) in self.ranks.iter_mut().enumerate() {
            let records = match direction {
                TransferDirection::Load => std::mem::take(&mut host.loads),
                TransferDirection::Offload => std::mem::take(&mut host.offloads),
                TransferDirection::Fetch => std::mem::take(&mut host.fetches),
            };
            if records.is_empty() {
                continue;
            }
            let n = pending_len(&records, direction);
            let (mut src, mut dst, mut keys) = (
                Vec::with_capacity(n),
                Vec::with_capacity(n),
                Vec::with_capacity(n),
            );
            for r in &records {
                if direction == TransferDirection::Fetch {
                    let staging = &r.src[r.fetch_start - r.src_offset..];
                    dst.extend(staging.iter().map(|b| b.id() as i32));
                    keys.extend_from_slice(&r.hashes[r.fetch_start..]);
                } else {
                    src.extend(
                        r.src[r.start - r.src_offset..]
                            .iter()
                            .map(|b| b.id() as i32),
                    );
                    dst.extend(r.chain[r.start..].iter().map(|b| b.id() as i32));
                    keys.extend_from_slice(&r.hashes[r.start..]);
                }
            }
            self.next_plan += 1;
            let id = self.next_plan;
            self.taken.insert(
                id,
                Taken {
                    rank,
                    direction,
                    records,
                },
            );
            plans.push(TransferPlan {
                dp_rank: rank,
                src,
                dst,
                keys,
                id,
                pool: self.pool,
                direction,
            });
        }
        plans
    }

    /// Checks `plans` for a completion in `direction`: made by this pool, of that direction,
    /// distinct and not completed yet.
    pub(crate) fn validate_plans(
        &self,
        plans: &[&TransferPlan],
        direction: TransferDirection,
    ) -> Result<()> {
        let what = direction.as_str();
        let mut seen = HashSet::with_capacity(plans.len());
        for (i, plan) in plans.iter().enumerate() {
            ensure_arg!(
                plan.pool == self.pool,
                "plans",
                "plans[{i}] was made by another pool"
            );
            ensure_arg!(
                plan.direction == direction,
                "plans",
                "plans[{i}] is not a {what} plan"
            );
            ensure_arg!(
                seen.insert(plan.id),
                "plans",
                "plans[{i}] appears twice in the list"
            );
            ensure_arg!(
                self.taken.contains_key(&plan.id),
                "plans",
                "plans[{i}] was already completed"
            );
        }
        Ok(())
    }

    /// The engine ran these (validated) load plans: publishes the loaded chains in the device
    /// caches (`devices[rank]`) and marks the tickets done. Returns the ranks touched.
    pub(crate) fn complete_loads(
        &mut self,
        plans: &[&TransferPlan],
        devices: &mut [Option<&mut PrefixCache>],
    ) -> Vec<usize> {
        let bs = self.block_size;
        let mut ranks = Vec::with_capacity(plans.len());
        for plan in plans {
            let Some(taken) = self.taken.remove(&plan.id) else {
                continue; // validated: unreachable
            };
            let rank = taken.rank;
            if let Some(Some(device)) = devices.get_mut(rank) {
                for record in &taken.records {
                    device.insert(
                        &record.hashes,
                        &record.tokens,
                        &record.chain,
                        0,
                        record.extra_key.as_ref(),
                        false,
                    );
                    record.pass_anchors(device);
                }
            }
            for record in &taken.records {
                if let Some(ticket) = &record.ticket {
                    ticket.finish(record.hashes.len() * bs);
                }
            }
            self.ranks[rank].stats.loaded_blocks +=
                pending_len(&taken.records, TransferDirection::Load) as u64;
            taken.release();
            self.drain(rank);
            ranks.push(rank);
        }
        ranks
    }

    /// The engine ran these (validated) offload plans: publishes the host chains in the host
    /// caches. Returns the ranks touched (their device blocks were released).
    pub(crate) fn complete_offloads(&mut self, plans: &[&TransferPlan]) -> Vec<usize> {
        let mut ranks = Vec::with_capacity(plans.len());
        for plan in plans {
            let Some(taken) = self.taken.remove(&plan.id) else {
                continue; // validated: unreachable
            };
            let rank = taken.rank;
            let host = &mut self.ranks[rank];
            if let Some(cache) = host.host.prefix_cache_mut() {
                for record in &taken.records {
                    cache.insert(
                        &record.hashes,
                        &record.tokens,
                        &record.chain,
                        0,
                        record.extra_key.as_ref(),
                        false,
                    );
                    record.pass_anchors(cache);
                }
            }
            for record in &taken.records {
                for hash in &record.hashes[record.start..] {
                    host.offloading.remove(&hash.0);
                }
            }
            host.stats.offloaded_blocks +=
                pending_len(&taken.records, TransferDirection::Offload) as u64;
            taken.release();
            self.drain(rank);
            ranks.push(rank);
        }
        ranks
    }
}
