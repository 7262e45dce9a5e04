//! The batch calls: a step's calls for many sequences at once (R16, R17) and the exports of
//! R19 (block tables, slot mapping). Every sequence is checked before anything changes (R29).

use crate::block::Block;
use crate::error::{ensure_arg, Result};
use crate::sequence::Sequence;

use super::{appended_len, BlockManagerPool, Publish};

impl BlockManagerPool {
    /// Checks what [`Self::advance`] requires of `seq` (allocated here, every token held)
    /// without changing anything.
    pub fn check_sequence_owned(&self, seq: &Sequence) -> Result<()> {
        ensure_arg!(
            self.check_owner_as(seq, "seqs")?,
            "seqs",
            "sequence {} is not allocated in this pool",
            seq.seq_id()
        );
        ensure_arg!(
            seq.len() <= seq.capacity(),
            "seqs",
            "sequence {} has {} tokens but its table holds {}: call may_append first",
            seq.seq_id(),
            seq.len(),
            seq.capacity()
        );
        Ok(())
    }

    /// One sequence's step after its checks: every token computed (R17), `cache` (R17, R24,
    /// R25), then the sampled token appended.
    #[inline]
    fn step(&mut self, seq: &mut Sequence, token: u32) {
        if self.host.is_some() {
            seq.sync(); // only a host tier hands out tickets
        }
        seq.compute_all();
        self.publish(seq, Publish::Step);
        seq.append_token(token);
    }

    /// After a forward step over every token of `seq`, in one call: `num_computed_tokens =
    /// len(seq)` (R17), `cache(seq)` publishes the full blocks, and the sampled `token` is
    /// appended (its slot comes from the next `may_append`, R16).
    pub fn advance(&mut self, seq: &mut Sequence, token: u32) -> Result<()> {
        self.check_sequence_owned(seq)?;
        self.generation += 1;
        self.step(seq, token);
        Ok(())
    }

    /// [`Self::advance`] for a batch: `tokens[i]` goes to `seqs[i]`. Every sequence is checked
    /// before any changes (R29: an error changes nothing); the sequences must be distinct.
    pub fn advance_all(&mut self, seqs: &mut [&mut Sequence], tokens: &[u32]) -> Result<()> {
        ensure_arg!(
            tokens.len() == seqs.len(),
            "token_ids",
            "has {} tokens for {} sequences",
            tokens.len(),
            seqs.len()
        );
        for seq in seqs.iter() {
            self.check_sequence_owned(seq)?;
        }
        self.generation += 1;
        for (seq, &token) in seqs.iter_mut().zip(tokens) {
            self.step(seq, token);
        }
        Ok(())
    }

    /// [`Self::advance_all`], then room for each sequence's next `lookahead + 1` tokens
    /// ([`Self::may_append_all`]) in the same pass: one call per decode step instead of two.
    /// Returns the indices of the sequences that got no room (advanced, but unable to take
    /// their next token's slot: grow them later or preempt them). An error changes nothing.
    pub fn advance_and_reserve_all(
        &mut self,
        seqs: &mut [&mut Sequence],
        tokens: &[u32],
        lookahead: usize,
    ) -> Result<Vec<usize>> {
        self.retry_pending()?; // before anything: a backend failure raised changes nothing
        self.advance_all(seqs, tokens)?; // checks every sequence
        Ok(self.grow_all(seqs, lookahead))
    }

    /// `may_append(seq, lookahead)` (R16) for a batch, after checking that every sequence is
    /// allocated here (an error changes nothing). Returns the indices of the sequences that
    /// could not get their blocks (those are unchanged): empty when every one did.
    pub fn may_append_all(
        &mut self,
        seqs: &mut [&mut Sequence],
        lookahead: usize,
    ) -> Result<Vec<usize>> {
        for seq in seqs.iter() {
            ensure_arg!(
                self.check_owner_as(seq, "seqs")?,
                "seqs",
                "sequence {} is not allocated in this pool",
                seq.seq_id()
            );
        }
        self.retry_pending()?;
        self.generation += 1;
        Ok(self.grow_all(seqs, lookahead))
    }

    /// The growth of [`Self::may_append_all`] for sequences already checked.
    fn grow_all(&mut self, seqs: &mut [&mut Sequence], lookahead: usize) -> Vec<usize> {
        let mut failed = Vec::new();
        for (i, seq) in seqs.iter_mut().enumerate() {
            let Some(tokens) = appended_len(seq, lookahead) else {
                failed.push(i); // F5: more tokens than usize can count
                continue;
            };
            if !self.slides && tokens <= seq.capacity() {
                continue; // the table holds them already (most decode steps)
            }
            if self.host.is_some() {
                seq.sync();
            }
            if !self.grow(seq, tokens) {
                failed.push(i);
            }
        }
        failed
    }

    /// R19: the block tables of `seqs` in group `group`, row-major
    /// `[len(seqs), max_blocks]`, padded with 0 (released window entries are 0 too).
    pub fn block_tables(&self, seqs: &[&Sequence], group: usize) -> Result<(Vec<i32>, usize)> {
        self.block_tables_padded(seqs, group, 0)
    }

    /// [`Self::block_tables`] padded with `pad` (an engine's own pad value, e.g. nano-vllm's
    /// -1); released window entries stay 0.
    pub fn block_tables_padded(
        &self,
        seqs: &[&Sequence],
        group: usize,
        pad: i32,
    ) -> Result<(Vec<i32>, usize)> {
        self.check_group(group)?;
        for seq in seqs {
            self.check_owner_as(seq, "seqs")?;
        }
        let width = seqs.iter().map(|s| s.blocks().len()).max().unwrap_or(0);
        let mut table = vec![pad; seqs.len() * width];
        for (row, seq) in table.chunks_exact_mut(width.max(1)).zip(seqs) {
            if group == 0 {
                for (slot, id) in row.iter_mut().zip(seq.block_ids()) {
                    *slot = id as i32;
                }
            } else if let Some(window) = seq.group_window_table(group) {
                for (slot, id) in row.iter_mut().zip(window.ids()) {
                    *slot = id as i32;
                }
            }
        }
        Ok((table, width))
    }

    /// R19: the cache slots, in group `group`, of tokens `[num_computed_tokens, len)` of every
    /// sequence; tokens a confirmed host load brought count as computed (R26).
    pub fn slot_mapping(&self, seqs: &[&Sequence], group: usize) -> Result<Vec<i64>> {
        self.slot_mapping_counts(seqs, group, None)
    }

    /// [`Self::slot_mapping`] of the next `counts[i]` tokens of `seqs[i]` from its
    /// `num_computed_tokens` (a chunked prefill's chunk), or of all its uncomputed tokens when
    /// `counts` is `None`. A count past `len(seq)`, or past what the table holds, is an error
    /// naming `num_tokens`.
    pub fn slot_mapping_counts(
        &self,
        seqs: &[&Sequence],
        group: usize,
        counts: Option<&[u32]>,
    ) -> Result<Vec<i64>> {
        self.check_group(group)?;
        let block_size = self.config.block_size;
        let mut total = 0;
        let mut ends = Vec::with_capacity(seqs.len());
        match counts {
            None => {
                for seq in seqs {
                    self.check_sequence_owned(seq)?;
                    total += seq.len() - seq.num_computed_tokens();
                    ends.push(seq.len());
                }
            }
            Some(counts) => {
                ensure_arg!(
                    counts.len() == seqs.len(),
                    "num_tokens",
                    "has {} counts for {} sequences",
                    counts.len(),
                    seqs.len()
                );
                for (seq, &count) in seqs.iter().zip(counts) {
                    ensure_arg!(
                        self.check_owner_as(seq, "seqs")?,
                        "seqs",
                        "sequence {} is not allocated in this pool",
                        seq.seq_id()
                    );
                    let end = seq.num_computed_tokens() + count as usize;
                    ensure_arg!(
                        end <= seq.len() && end <= seq.capacity(),
                        "num_tokens",
                        "sequence {}: {} computed + {count} tokens exceed its {} tokens or the {} \
                         its table holds",
                        seq.seq_id(),
                        seq.num_computed_tokens(),
                        seq.len(),
                        seq.capacity()
                    );
                    total += count as usize;
                    ends.push(end);
                }
            }
        }
        let mut slots = Vec::with_capacity(total);
        for (seq, &end) in seqs.iter().zip(&ends) {
            let blocks = seq.blocks();
            let window = seq.group_window_table(group);
            for position in seq.num_computed_tokens()..end {
                let index = position / block_size;
                let id = if group == 0 {
                    blocks[index].id()
                } else {
                    // Held: released entries lie before `num_computed_tokens` (R25).
                    window.and_then(|w| w.get(index)).map_or(0, Block::id)
                };
                slots.push(id as i64 * block_size as i64 + (position % block_size) as i64);
            }
        }
        Ok(slots)
    }

    fn check_group(&self, group: usize) -> Result<()> {
        ensure_arg!(
            group < self.num_groups(),
            "group",
            "this pool has {} group(s), got {group}",
            self.num_groups()
        );
        Ok(())
    }
}
