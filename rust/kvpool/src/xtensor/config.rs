//! The options of an [`XTensorBlockManager`](super::XTensorBlockManager) and the figures it
//! reports: [`XTensorConfig`] (validated before anything is allocated), [`PageStats`] and
//! [`MemoryLimitReport`].

use crate::error::{ensure_arg, Result};
use crate::hash::BlockHasher;
use crate::manager::ManagerConfig;
use crate::xtensor::pages::PageTable;

/// Default bytes per page: 2 MiB, CUDA's allocation granularity (and kvcached's page).
pub const DEFAULT_PAGE_BYTES: u64 = 2 << 20;

/// Most blocks one page may hold.
pub const MAX_BLOCKS_PER_PAGE: usize = 1 << 16;

/// Options of an [`XTensorBlockManager`].
#[derive(Clone, Copy, Debug)]
pub struct XTensorConfig {
    /// Ids in the pool, padding block 0 included (>= 2).
    pub num_blocks: usize,
    /// Tokens per block (>= 1).
    pub block_size: usize,
    /// Blocks per page (1..=[`MAX_BLOCKS_PER_PAGE`]); the last page may hold fewer.
    pub blocks_per_page: usize,
    /// Memory one page costs when mapped (all layers, K and V), for `mapped_bytes` and the
    /// memory limit.
    pub page_bytes: u64,
    /// Empty pages kept mapped, ready for the next allocations (the preallocation): the
    /// manager maps ahead below `spare_pages` empty pages and unmaps above `2 * spare_pages`.
    pub spare_pages: usize,
    /// Bytes that may be mapped at once (`None`: the whole range); page 0 counts.
    pub memory_limit: Option<u64>,
    /// Keep a prefix cache.
    pub enable_prefix_cache: bool,
    /// Hasher of the prefix cache.
    pub hasher: BlockHasher,
}

impl XTensorConfig {
    /// Defaults: 2 MiB pages, one spare page, no memory limit, prefix cache on.
    pub fn new(num_blocks: usize, block_size: usize, blocks_per_page: usize) -> Self {
        Self {
            num_blocks,
            block_size,
            blocks_per_page,
            page_bytes: DEFAULT_PAGE_BYTES,
            spare_pages: 1,
            memory_limit: None,
            enable_prefix_cache: true,
            hasher: BlockHasher::default(),
        }
    }

    /// Pages of the range: `ceil(num_blocks / blocks_per_page)`.
    pub fn num_pages(&self) -> usize {
        self.num_blocks.div_ceil(self.blocks_per_page.max(1))
    }

    pub(crate) fn as_manager_config(&self) -> ManagerConfig {
        ManagerConfig {
            num_blocks: self.num_blocks,
            block_size: self.block_size,
            enable_prefix_cache: self.enable_prefix_cache,
            hasher: self.hasher,
        }
    }

    /// Validates the numbers (R1, R29).
    pub fn validate(&self) -> Result<()> {
        self.as_manager_config().validate()?;
        ensure_arg!(
            (1..=MAX_BLOCKS_PER_PAGE).contains(&self.blocks_per_page),
            "blocks_per_page",
            "must be in 1..={MAX_BLOCKS_PER_PAGE}, got {}",
            self.blocks_per_page
        );
        ensure_arg!(
            self.page_bytes >= 1,
            "page_bytes",
            "must be at least 1, got {}",
            self.page_bytes
        );
        ensure_arg!(
            self.page_bytes
                .checked_mul(self.num_pages() as u64)
                .is_some(),
            "page_bytes",
            "{} pages of {} bytes overflow 64 bits",
            self.num_pages(),
            self.page_bytes
        );
        ensure_arg!(
            self.spare_pages <= self.num_pages(),
            "spare_pages",
            "must be at most the number of pages ({}), got {}",
            self.num_pages(),
            self.spare_pages
        );
        Ok(())
    }

    /// Bytes a manager of this config allocates (for [`crate::alloc::probe`]).
    pub(crate) fn footprint(&self) -> u128 {
        let ids = self.as_manager_config().footprint()
            + self.num_blocks as u128 * PageTable::BYTES_PER_ID;
        ids + self.num_pages() as u128 * PageTable::BYTES_PER_PAGE
    }
}

/// Page counters of a manager's life.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageStats {
    /// Pages mapped (page 0 included).
    pub maps: u64,
    /// Pages unmapped.
    pub unmaps: u64,
    /// Maps the backend refused for lack of memory.
    pub map_failures: u64,
    /// Most pages mapped at once.
    pub peak_mapped_pages: usize,
}

/// What [`XTensorBlockManager::set_memory_limit`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryLimitReport {
    /// The new limit (`None`: the whole range).
    pub limit_bytes: Option<u64>,
    /// Pages the limit allows (`limit_bytes / page_bytes`, at most the range).
    pub limit_pages: usize,
    /// Pages mapped now.
    pub mapped_pages: usize,
    /// Bytes mapped now.
    pub mapped_bytes: u64,
    /// Cached blocks evicted to return memory.
    pub evicted_blocks: usize,
    /// Pages unmapped.
    pub unmapped_pages: usize,
    /// Pages mapped (spares, when the limit was raised).
    pub mapped_new_pages: usize,
    /// Blocks of the reservation given up because the limit cut the pages it needed.
    pub released_reserved_blocks: usize,
    /// Bytes mapped above the limit: what could not be freed, because sequences hold blocks on
    /// those pages (0 when the limit is met). They are returned as the sequences release them.
    pub excess_bytes: u64,
    /// Mapped pages on which sequences hold blocks (page 0 included when it holds one).
    pub held_pages: usize,
}
