//! [`HostTier::check`]: the host managers and every pending plan (the module doc's invariants).

use std::collections::HashSet;

use crate::error::{ensure_invariant, Result};
use crate::manager::{BlockManager, BlockManagerImpl};

use super::{HostTier, Pending, TransferDirection};

impl HostTier {
    /// Walks the host manager of every rank and every pending record against the device managers
    /// (`devices[rank]`).
    pub(crate) fn check(&self, devices: &[&BlockManagerImpl]) -> Result<()> {
        let mut records: Vec<Vec<(TransferDirection, &Pending)>> =
            (0..self.ranks.len()).map(|_| Vec::new()).collect();
        for (rank, host) in self.ranks.iter().enumerate() {
            host.host
                .check()
                .map_err(|e| e.in_rank(rank, "host tier"))?;
            records[rank].extend(host.loads.iter().map(|r| (TransferDirection::Load, r)));
            records[rank].extend(
                host.offloads
                    .iter()
                    .map(|r| (TransferDirection::Offload, r)),
            );
            records[rank].extend(host.fetches.iter().map(|r| (TransferDirection::Fetch, r)));
        }
        ensure_invariant!(
            devices.len() == self.ranks.len(),
            "{} device ranks for {} host ranks",
            devices.len(),
            self.ranks.len()
        );
        for taken in self.taken.values() {
            ensure_invariant!(
                taken.rank < self.ranks.len(),
                "plan of rank {} out of range",
                taken.rank
            );
            records[taken.rank].extend(taken.records.iter().map(|r| (taken.direction, r)));
        }
        for (rank, records) in records.iter().enumerate() {
            self.check_rank(rank, records, devices[rank])?;
        }
        Ok(())
    }

    fn check_rank(
        &self,
        rank: usize,
        records: &[(TransferDirection, &Pending)],
        device: &BlockManagerImpl,
    ) -> Result<()> {
        let bs = self.block_size;
        let host = &self.ranks[rank];
        let mut load_dst = HashSet::new();
        let mut offload_dst = HashSet::new();
        let mut staging = HashSet::new();
        let mut offloading = HashSet::new();
        for &(direction, r) in records {
            let n = r.hashes.len();
            ensure_invariant!(
                r.chain.len() == n
                    && r.src_offset + r.src.len() == n
                    && r.start < n
                    && r.tokens.len() == n * bs,
                "dp rank {rank}: pending {direction:?} record has inconsistent lengths"
            );
            let is_fetch = direction == TransferDirection::Fetch;
            // A source that starts past block 0 holds only staging blocks: a fetch, or a load
            // that a completed fetch left (see `Pending`).
            let staging_only = r.src.iter().all(|b| !b.is_cached());
            ensure_invariant!(
                r.start <= r.fetch_start
                    && r.fetch_start <= n
                    && (r.fetch_start < n) == is_fetch
                    && (r.src_offset == 0
                        || (staging_only && (!is_fetch || r.src_offset == r.fetch_start))),
                "dp rank {rank}: pending {direction:?} record has an inconsistent fetch part"
            );
            let (src_tier, dst_tier): (&BlockManagerImpl, &BlockManagerImpl) = match direction {
                TransferDirection::Load | TransferDirection::Fetch => (&host.host, device),
                TransferDirection::Offload => (device, &host.host),
            };
            for b in &r.src[r.fetch_start.min(n) - r.src_offset..] {
                ensure_invariant!(
                    !b.is_cached() && staging.insert(b.id()),
                    "dp rank {rank}: host staging block {} is cached or staged twice",
                    b.id()
                );
            }
            ensure_invariant!(
                r.src.iter().all(|b| src_tier.owns(b) && b.ref_count() >= 1)
                    && r.chain
                        .iter()
                        .all(|b| dst_tier.owns(b) && b.ref_count() >= 1),
                "dp rank {rank}: pending {direction:?} names a block of the wrong tier (R26)"
            );
            for b in &r.chain[r.start..] {
                let fresh = match direction {
                    TransferDirection::Load | TransferDirection::Fetch => load_dst.insert(b.id()),
                    TransferDirection::Offload => {
                        ensure_invariant!(
                            !b.is_cached(),
                            "dp rank {rank}: host block {} is cached before its offload completed",
                            b.id()
                        );
                        offload_dst.insert(b.id())
                    }
                };
                ensure_invariant!(
                    fresh,
                    "dp rank {rank}: block {} is the destination of two pending copies",
                    b.id()
                );
            }
            if direction == TransferDirection::Offload {
                for h in &r.hashes[r.start..] {
                    ensure_invariant!(
                        offloading.insert(h.0),
                        "dp rank {rank}: a block is offloaded twice (R26)"
                    );
                }
            }
            if let Some(ticket) = &r.ticket {
                ensure_invariant!(
                    ticket.promised() == n * bs && ticket.done_tokens().is_none(),
                    "dp rank {rank}: load ticket out of step with its record"
                );
            }
        }
        ensure_invariant!(
            offloading == host.offloading,
            "dp rank {rank}: offloading set differs from the pending offloads"
        );
        Ok(())
    }
}
