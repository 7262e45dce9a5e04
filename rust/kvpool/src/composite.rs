//! `CompositeBlockManager`: several block groups in one manager (R25), e.g. the full-attention
//! layers and the sliding-window layers of a Gemma / gpt-oss style model.
//!
//! A configuration of the pool's group abstraction (`groups/`): each group is a full-attention
//! group or a sliding-window group with its own id space and block size, and a sequence holds
//! one table per group ([`GroupTables`]). Sliding-window groups release the blocks no future query
//! can attend to whenever the manager touches the sequence. Like xLLM's CompositeBlockManager
//! this standalone manager keeps no prefix cache; `BlockManagerPool(sliding_window=w)` builds the
//! two-group case with prefix sharing (see `sliding_window.rs` for the rule).
//!
//! Invariants: every group obeys R1-R5 on its own; `allocate_for_sequence` is all-or-nothing
//! across groups (a failure in group g gives back what groups before g took).

use crate::block::Block;
use crate::error::{ensure_arg, KvPoolError, Result};
use crate::groups::{FullGroup, WindowGroup};
use crate::manager::{BlockCounts, BlockManager, BlockManagerImpl, ManagerConfig};
use crate::sliding_window::{SlidingWindowBlockManager, WindowTable};

/// Shape of one group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupSpec {
    /// Ids of the group, padding 0 included.
    pub num_blocks: usize,
    /// Tokens per block of the group.
    pub block_size: usize,
    /// Sliding window in tokens, or `None` for full attention.
    pub window: Option<usize>,
}

enum Kind {
    /// Full attention: blocks stay for the sequence's life.
    Full(FullGroup),
    /// Sliding window: blocks behind the window are released.
    Window(WindowGroup),
}

/// The allocator of one group.
pub struct GroupManager {
    kind: Kind,
}

impl GroupManager {
    /// The group's manager as the common trait.
    pub fn as_manager(&self) -> &dyn BlockManager {
        match &self.kind {
            Kind::Full(g) => g.as_dyn(),
            Kind::Window(g) => g.manager(),
        }
    }

    /// The group's manager as the common trait.
    pub fn as_manager_mut(&mut self) -> &mut dyn BlockManager {
        match &mut self.kind {
            Kind::Full(g) => g.as_dyn_mut(),
            Kind::Window(g) => g.manager_mut(),
        }
    }

    /// The window, for sliding-window groups.
    pub fn window(&self) -> Option<usize> {
        match &self.kind {
            Kind::Full(_) => None,
            Kind::Window(g) => Some(g.manager().window()),
        }
    }

    /// Whether `need` more entries can be had once `table` slid to `computed`.
    fn room(&self, table: &WindowTable, computed: usize, need: usize) -> bool {
        match &self.kind {
            Kind::Full(g) => need <= g.num_available(),
            Kind::Window(g) => g.room(table, computed, need),
        }
    }

    fn slide(&mut self, table: &mut WindowTable, computed: usize) {
        if let Kind::Window(g) = &mut self.kind {
            g.slide(table, computed);
        }
    }

    fn grow(&mut self, table: &mut WindowTable, entries: usize) -> Result<()> {
        let ok = match &mut self.kind {
            Kind::Full(g) => {
                let need = entries.saturating_sub(table.len());
                match g.num_available() >= need {
                    true => g.grow(&mut table.blocks, need),
                    false => false,
                }
            }
            Kind::Window(g) => g.grow(table, entries),
        };
        match ok {
            true => Ok(()),
            false => Err(KvPoolError::OutOfBlocks {
                requested: entries.saturating_sub(table.len()),
                available: self.as_manager().counts().available(),
            }),
        }
    }
}

/// A sequence's tables, one per group (released sliding-window entries are padding 0).
#[derive(Debug, Default)]
pub struct GroupTables {
    tables: Vec<WindowTable>,
}

impl GroupTables {
    /// The table of group `g`.
    pub fn table(&self, g: usize) -> Option<&WindowTable> {
        self.tables.get(g)
    }

    /// Block ids of group `g`'s table (0 for released entries).
    pub fn ids(&self, g: usize) -> Vec<u32> {
        self.tables
            .get(g)
            .map_or_else(Vec::new, |t| t.ids().collect())
    }
}

/// Several block groups behind one allocator (xLLM's `CompositeBlockManager`).
pub struct CompositeBlockManager {
    groups: Vec<GroupManager>,
}

impl CompositeBlockManager {
    /// One group per spec.
    pub fn new(specs: &[GroupSpec]) -> Result<Self> {
        ensure_arg!(!specs.is_empty(), "groups", "needs at least one group");
        let mut groups = Vec::with_capacity(specs.len());
        for (i, spec) in specs.iter().enumerate() {
            // R29: the argument is `groups`; the message says which group and which field.
            let in_group = |e| match e {
                KvPoolError::InvalidArgument { name, message } => {
                    KvPoolError::invalid("groups", format!("groups[{i}].{name}: {message}"))
                }
                other => other,
            };
            let kind = match spec.window {
                None => {
                    let mut config = ManagerConfig::new(spec.num_blocks, spec.block_size);
                    config.enable_prefix_cache = false;
                    Kind::Full(FullGroup::new(
                        BlockManagerImpl::new(config).map_err(in_group)?,
                    ))
                }
                Some(window) => Kind::Window(WindowGroup::new(
                    SlidingWindowBlockManager::new(spec.num_blocks, spec.block_size, window, false)
                        .map_err(in_group)?,
                )),
            };
            groups.push(GroupManager { kind });
        }
        Ok(Self { groups })
    }

    /// Number of groups.
    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }

    fn group_error(&self, g: usize) -> KvPoolError {
        KvPoolError::invalid("group", format!("must be < {}, got {g}", self.groups.len()))
    }

    /// Group `g`.
    pub fn group(&self, g: usize) -> Result<&GroupManager> {
        self.groups.get(g).ok_or_else(|| self.group_error(g))
    }

    /// Group `g`.
    pub fn group_mut(&mut self, g: usize) -> Result<&mut GroupManager> {
        let error = self.group_error(g);
        self.groups.get_mut(g).ok_or(error)
    }

    /// Block counts of group `g`.
    pub fn counts(&self, g: usize) -> Result<BlockCounts> {
        Ok(self.group(g)?.as_manager().counts())
    }

    fn entries(group: &GroupManager, num_tokens: usize) -> usize {
        num_tokens.div_ceil(group.as_manager().block_size())
    }

    /// Whether `allocate_for_sequence` would succeed, with no side effect.
    pub fn can_allocate_for_sequence(
        &self,
        tables: &GroupTables,
        num_tokens: usize,
        num_computed_tokens: usize,
    ) -> bool {
        let empty = WindowTable::default();
        self.groups.iter().enumerate().all(|(g, group)| {
            let table = tables.tables.get(g).unwrap_or(&empty);
            let need = Self::entries(group, num_tokens).saturating_sub(table.len());
            group.room(table, num_computed_tokens, need)
        })
    }

    /// Grows every group's table to hold `num_tokens` tokens, after releasing the window blocks
    /// behind `num_computed_tokens` (all-or-nothing across groups).
    pub fn allocate_for_sequence(
        &mut self,
        tables: &mut GroupTables,
        num_tokens: usize,
        num_computed_tokens: usize,
    ) -> Result<()> {
        ensure_arg!(
            num_computed_tokens <= num_tokens,
            "num_computed_tokens",
            "{num_computed_tokens} exceeds num_tokens {num_tokens}"
        );
        tables
            .tables
            .resize_with(self.groups.len(), WindowTable::default);
        for (group, table) in self.groups.iter_mut().zip(tables.tables.iter_mut()) {
            group.slide(table, num_computed_tokens);
        }
        let before: Vec<usize> = tables.tables.iter().map(|t| t.blocks.len()).collect();
        for g in 0..self.groups.len() {
            let entries = Self::entries(&self.groups[g], num_tokens);
            if let Err(error) = self.groups[g].grow(&mut tables.tables[g], entries) {
                for (table, &len) in tables.tables.iter_mut().zip(&before).take(g) {
                    table.blocks.truncate(len);
                }
                return Err(error);
            }
        }
        Ok(())
    }

    /// Releases every table (xLLM's `deallocate_sequence`).
    pub fn deallocate_sequence(&mut self, tables: &mut GroupTables) {
        for table in &mut tables.tables {
            table.clear();
        }
    }

    /// The group whose manager handed out `block`, if any.
    pub fn owner_of(&self, block: &Block) -> Option<usize> {
        self.groups.iter().position(|g| g.as_manager().owns(block))
    }

    /// Walks every group (R2 per group).
    pub fn check(&self) -> Result<()> {
        for (g, group) in self.groups.iter().enumerate() {
            group.as_manager().check().map_err(|e| match e {
                KvPoolError::Invariant(m) => KvPoolError::Invariant(format!("group {g}: {m}")),
                other => other,
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_grow_together_and_the_window_slides() {
        let mut manager = CompositeBlockManager::new(&[
            GroupSpec {
                num_blocks: 9,
                block_size: 4,
                window: None,
            },
            GroupSpec {
                num_blocks: 5,
                block_size: 4,
                window: Some(8),
            },
        ])
        .unwrap();
        let mut tables = GroupTables::default();
        manager.allocate_for_sequence(&mut tables, 16, 0).unwrap();
        assert_eq!(tables.ids(1).len(), 4);
        // The window group is out of blocks unless it slides: computed 16 frees 2 blocks.
        assert!(!manager.can_allocate_for_sequence(&tables, 24, 0));
        assert!(manager.can_allocate_for_sequence(&tables, 24, 16));
        manager.allocate_for_sequence(&mut tables, 24, 16).unwrap();
        assert_eq!(&tables.ids(1)[..2], &[0, 0]);
        assert_eq!(tables.ids(0).len(), 6);
        manager.check().unwrap();
        // All-or-nothing: the full group is short, nothing changes.
        let before = manager.counts(1).unwrap();
        assert!(manager.allocate_for_sequence(&mut tables, 64, 16).is_err());
        assert_eq!(manager.counts(1).unwrap(), before);
        manager.deallocate_sequence(&mut tables);
        assert_eq!(manager.counts(0).unwrap().free, 8);
        assert_eq!(manager.counts(1).unwrap().free, 4);
    }
}
