//! The remote tier behind the host tier: fetch records and their completion.
//!
//! The core does no I/O. Before an admission the caller asks what lies past the device+host
//! reach (the pool's `remote_query`), asks the remote tier in one batched existence query, and
//! hands the answer back as [`RemoteHits`] (the pool's `allocate_with_remote`); the lookup policy
//! (budget, timing, counters, what a failure means) is the caller's (`kvpool.tiers.lookup` in
//! Python). Remote hits get device blocks and host staging blocks; the record is a fetch until
//! [`HostTier::complete_fetches`] reports what arrived, then a load of the leading run that did.
//!
//! Remote hits are taken only by ranks whose groups are full attention alone: a fetch can fail in
//! part, and a linear state restored at the hit's boundary, or a window table taken for it, could
//! not be matched to the shorter prefix that arrived (docs/host_tier.md).

use crate::error::{ensure_arg, Result};

use super::{HostTier, RemoteHits, RemoteQuery, TransferDirection, TransferPlan};
use crate::hash::BlockHash;

impl HostTier {
    /// What to ask the remote tier for a chain of `query` full blocks (`hashes`) whose local
    /// reach is `reach` blocks; `None` when the local tiers cover it.
    pub(crate) fn remote_query(
        hashes: &[BlockHash],
        reach: usize,
        query: usize,
    ) -> Option<RemoteQuery> {
        (reach < query).then(|| RemoteQuery {
            from: reach,
            hashes: hashes[reach..query].to_vec(),
        })
    }

    /// The end of the load the remote answer `hits` extends a local reach of `reach` blocks to
    /// (at most `query`): ignored unless the hits start at or before the reach.
    pub(crate) fn remote_end(hits: Option<RemoteHits>, reach: usize, query: usize) -> usize {
        match hits {
            Some(h) if h.from <= reach && reach < h.to => h.to.min(query),
            _ => reach,
        }
    }

    /// Confirms that the engine ran these fetch plans: `arrived[i][j]` says whether block `j` of
    /// `plans[i]` arrived intact in its host staging block (`None`: all did). Each record keeps
    /// the leading run of arrived blocks and becomes a load; its sequence's ticket then promises
    /// only that much. A record with nothing left to load is dropped and its ticket marked done at
    /// the device hit: the sequence recomputes the rest. Foreign, repeated or already-completed
    /// plans, or `arrived` of the wrong shape, are an `InvalidArgument`; nothing changes then.
    pub(crate) fn complete_fetches(
        &mut self,
        plans: &[&TransferPlan],
        arrived: Option<&[Vec<bool>]>,
    ) -> Result<()> {
        self.validate_plans(plans, TransferDirection::Fetch)?;
        if let Some(arrived) = arrived {
            ensure_arg!(
                arrived.len() == plans.len(),
                "arrived",
                "has {} entries for {} plans",
                arrived.len(),
                plans.len()
            );
            for (i, (a, plan)) in arrived.iter().zip(plans).enumerate() {
                ensure_arg!(
                    a.len() == plan.len(),
                    "arrived",
                    "arrived[{i}] has {} entries, plans[{i}] fetches {} blocks",
                    a.len(),
                    plan.len()
                );
            }
        }
        let bs = self.block_size;
        for (i, plan) in plans.iter().enumerate() {
            let Some(taken) = self.taken.remove(&plan.id) else {
                continue; // validated: unreachable
            };
            let rank = taken.rank;
            let host = &mut self.ranks[rank];
            let mut offset = 0;
            for mut record in taken.records {
                let k = record.pending(TransferDirection::Fetch);
                let ok = match arrived {
                    Some(arrived) => arrived[i][offset..offset + k]
                        .iter()
                        .take_while(|&&ok| ok)
                        .count(),
                    None => k,
                };
                offset += k;
                host.stats.fetched_blocks += ok as u64;
                host.stats.failed_fetch_blocks += (k - ok) as u64;
                let end = record.fetch_start + ok;
                if end > record.start {
                    record.truncate(end, bs);
                    if let Some(ticket) = &record.ticket {
                        ticket.shrink(end * bs);
                    }
                    host.loads.push(record);
                } else if let Some(ticket) = &record.ticket {
                    ticket.finish(record.start * bs);
                }
            }
            self.drain(rank);
        }
        Ok(())
    }

    /// [`Self::complete_fetches`] with nothing arrived: the remote tier failed (timeout, lost
    /// connection, corrupt payloads). The host parts of the records still load.
    pub(crate) fn fail_fetches(&mut self, plans: &[&TransferPlan]) -> Result<()> {
        let arrived: Vec<Vec<bool>> = plans.iter().map(|p| vec![false; p.len()]).collect();
        self.complete_fetches(plans, Some(&arrived))
    }
}
