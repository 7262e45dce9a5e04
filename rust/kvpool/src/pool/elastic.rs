//! Elastic KV memory in the pool (xLLM's `enable_xtensor`): [`XTensorOptions`], the pool
//! option that gives every dp rank an `XTensorBlockManager` as its full-attention allocator, the
//! per-rank memory limit ([`BlockManagerPool::set_memory_limit`]) and the mapped-memory figures
//! ([`XTensorRankStats`]).
//!
//! Invariants: every rank of a pool built with the option allocates on elastic pages and keeps
//! the page rules of `XTensorBlockManager` (mapped pages are page 0, the pages holding a used or
//! cached block, and the spares; at most the limit's pages unless sequences hold the excess),
//! which `check()` walks; the pool's accounting (R2, R13's rank choice, R15/R16's `can_*`) reads
//! the rank's `num_available_blocks`, which counts the unmapped pages the limit allows, so an
//! admission the pool promises is one the pages can give. No host tier with elastic pages.

use crate::error::{ensure_arg, KvPoolError, Result};
use crate::xtensor::{
    AccountingBackend, MemoryLimitReport, PageBackend, XTensorBlockManager, XTensorConfig,
    DEFAULT_PAGE_BYTES,
};

use super::{BlockManagerPool, PoolConfig};

/// Which page backend each rank's pages are mapped through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageBackendKind {
    /// Accounting only: pages cost nothing but are counted (simulation, tests).
    Accounting,
    /// One reserved anonymous mapping per rank, pages committed on use and returned to the OS
    /// (`HostPageBackend`): the process's resident memory follows the mapped pages.
    Host,
    /// Backends the caller gives ([`BlockManagerPool::with_page_backends`], e.g. CUDA's).
    Custom,
}

/// The pool's `xtensor` option: every rank's full-attention blocks on elastic pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct XTensorOptions {
    /// Blocks per page.
    pub blocks_per_page: usize,
    /// Bytes one mapped page costs (all layers, K and V).
    pub page_bytes: u64,
    /// Empty pages kept mapped per rank (the preallocation band `spare_pages..=2*spare_pages`).
    pub spare_pages: usize,
    /// Bytes each rank may map (`None`: its whole range).
    pub memory_limit: Option<u64>,
    /// The page backend of every rank.
    pub backend: PageBackendKind,
}

impl XTensorOptions {
    /// Defaults: 2 MiB pages, one spare page, no limit, the accounting backend.
    pub fn new(blocks_per_page: usize) -> Self {
        Self {
            blocks_per_page,
            page_bytes: DEFAULT_PAGE_BYTES,
            spare_pages: 1,
            memory_limit: None,
            backend: PageBackendKind::Accounting,
        }
    }

    /// The manager config of one rank of `pool`.
    pub(crate) fn manager_config(&self, pool: &PoolConfig) -> XTensorConfig {
        XTensorConfig {
            num_blocks: pool.num_blocks,
            block_size: pool.block_size,
            blocks_per_page: self.blocks_per_page,
            page_bytes: self.page_bytes,
            spare_pages: self.spare_pages,
            memory_limit: self.memory_limit,
            enable_prefix_cache: pool.enable_prefix_cache,
            hasher: pool.hasher,
        }
    }

    /// Checks the options against `pool` (errors name `xtensor.<field>`).
    pub(crate) fn validate(&self, pool: &PoolConfig) -> Result<()> {
        ensure_arg!(
            pool.host.is_none(),
            "xtensor",
            "elastic pages do not combine with a host tier"
        );
        self.manager_config(pool).validate().map_err(|e| {
            e.renamed("blocks_per_page", "xtensor.blocks_per_page")
                .renamed("page_bytes", "xtensor.page_bytes")
                .renamed("spare_pages", "xtensor.spare_pages")
        })
    }

    /// The backend of one rank (for `Custom`, none: the caller gives them).
    pub(crate) fn backend(&self, pool: &PoolConfig) -> Result<Option<Box<dyn PageBackend>>> {
        let num_pages = self.manager_config(pool).num_pages();
        match self.backend {
            PageBackendKind::Accounting => Ok(Some(Box::new(AccountingBackend::new(num_pages)))),
            #[cfg(unix)]
            PageBackendKind::Host => {
                let page_bytes = usize::try_from(self.page_bytes).map_err(|_| {
                    KvPoolError::invalid("xtensor.page_bytes", "does not fit the address space")
                })?;
                let backend = crate::xtensor::HostPageBackend::new(num_pages, page_bytes)
                    .map_err(|e| e.renamed("page_bytes", "xtensor.page_bytes"))?;
                Ok(Some(Box::new(backend)))
            }
            #[cfg(not(unix))]
            PageBackendKind::Host => Err(KvPoolError::invalid(
                "xtensor.backend",
                "the host backend needs a unix system",
            )),
            PageBackendKind::Custom => Ok(None),
        }
    }
}

/// Mapped memory of one rank (or the sum over the ranks), in a pool on elastic pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct XTensorRankStats {
    /// Pages of the range (per rank: `ceil(num_blocks / blocks_per_page)`).
    pub num_pages: usize,
    /// Pages mapped now, page 0 included.
    pub mapped_pages: usize,
    /// Bytes mapped now.
    pub mapped_bytes: u64,
    /// Mapped pages with no used or cached block (the spares).
    pub spare_pages: usize,
    /// Pages the memory limit allows.
    pub limit_pages: usize,
    /// Bytes the limit allows (`limit_pages * page_bytes`).
    pub limit_bytes: u64,
    /// Most pages mapped at once (for the total: the sum of the ranks' peaks).
    pub peak_mapped_pages: usize,
    /// Pages mapped so far.
    pub num_page_maps: u64,
    /// Pages unmapped so far.
    pub num_page_unmaps: u64,
    /// Maps the backend refused for lack of memory.
    pub num_map_failures: u64,
}

impl XTensorRankStats {
    pub(crate) fn of(manager: &XTensorBlockManager) -> Self {
        let pages = manager.page_stats();
        Self {
            num_pages: manager.num_pages(),
            mapped_pages: manager.mapped_pages(),
            mapped_bytes: manager.mapped_bytes(),
            spare_pages: manager.pages.empty_len(),
            limit_pages: manager.limit_pages(),
            limit_bytes: manager.limit_pages() as u64 * manager.page_bytes(),
            peak_mapped_pages: pages.peak_mapped_pages,
            num_page_maps: pages.maps,
            num_page_unmaps: pages.unmaps,
            num_map_failures: pages.map_failures,
        }
    }

    pub(crate) fn add(&mut self, other: &Self) {
        self.num_pages += other.num_pages;
        self.mapped_pages += other.mapped_pages;
        self.mapped_bytes += other.mapped_bytes;
        self.spare_pages += other.spare_pages;
        self.limit_pages += other.limit_pages;
        self.limit_bytes += other.limit_bytes;
        self.peak_mapped_pages += other.peak_mapped_pages;
        self.num_page_maps += other.num_page_maps;
        self.num_page_unmaps += other.num_page_unmaps;
        self.num_map_failures += other.num_map_failures;
    }

    /// `(key, value)` of every figure, in order (what the bindings build their dict from).
    pub fn visit(&self, mut f: impl FnMut(&'static str, u64)) {
        f("num_pages", self.num_pages as u64);
        f("mapped_pages", self.mapped_pages as u64);
        f("mapped_bytes", self.mapped_bytes);
        f("spare_pages", self.spare_pages as u64);
        f("limit_pages", self.limit_pages as u64);
        f("limit_bytes", self.limit_bytes);
        f("peak_mapped_pages", self.peak_mapped_pages as u64);
        f("num_page_maps", self.num_page_maps);
        f("num_page_unmaps", self.num_page_unmaps);
        f("num_map_failures", self.num_map_failures);
    }
}

impl BlockManagerPool {
    /// A pool on elastic pages whose rank `r` maps its pages through `backends[r]` (the CUDA
    /// backend, a test's fake); `config.xtensor` must be set, its backend `Custom`.
    pub fn with_page_backends(
        mut config: PoolConfig,
        backends: Vec<Box<dyn PageBackend>>,
    ) -> Result<Self> {
        let Some(options) = config.xtensor.as_mut() else {
            return Err(KvPoolError::invalid(
                "xtensor",
                "page backends need the xtensor option",
            ));
        };
        options.backend = PageBackendKind::Custom;
        ensure_arg!(
            backends.len() == config.dp_size,
            "backends",
            "one backend per dp rank: {} for dp_size {}",
            backends.len(),
            config.dp_size
        );
        Self::build(config, backends)
    }

    /// Whether the ranks allocate on elastic pages.
    pub fn is_elastic(&self) -> bool {
        self.config.xtensor.is_some()
    }

    /// Before a call that may allocate does anything: retries what a page backend failure left
    /// pending on any rank (unmaps of pages already empty, maps of spares; never an eviction).
    /// An error here is raised by the call, which has then done nothing (docs/xtensor.md, "A
    /// failing backend"). Failures met later in the call are deferred to the next one.
    #[inline]
    pub(crate) fn retry_pending(&mut self) -> Result<()> {
        if self.is_elastic() {
            for rank in &mut self.ranks {
                if let Some(manager) = rank.full.elastic_manager_mut() {
                    manager.retry_pending()?;
                }
            }
        }
        Ok(())
    }

    /// The elastic allocator of `rank`, if the pool is on elastic pages.
    pub fn xtensor_manager(&self, rank: usize) -> Option<&XTensorBlockManager> {
        self.ranks.get(rank)?.full.elastic_manager()
    }

    /// Sets the memory limit of `rank` (`None`: of every rank) to `limit` bytes (`None`: the
    /// whole range): lowering it evicts cached blocks page by page and unmaps what empties; what
    /// sequences hold stays mapped and is reported, and returns as they release it. One report
    /// per rank set. An error naming `limit` if the pool is not on elastic pages, `rank` past
    /// the last.
    pub fn set_memory_limit(
        &mut self,
        limit: Option<u64>,
        rank: Option<usize>,
    ) -> Result<Vec<MemoryLimitReport>> {
        ensure_arg!(
            self.is_elastic(),
            "limit",
            "this pool is not on elastic pages (build it with the xtensor option)"
        );
        let ranks = match rank {
            Some(r) if r >= self.ranks.len() => return Err(self.rank_error(r)),
            Some(r) => r..r + 1,
            None => 0..self.ranks.len(),
        };
        self.generation += 1;
        let mut reports = Vec::with_capacity(ranks.len());
        for index in ranks {
            let Some(manager) = self.ranks[index].full.elastic_manager_mut() else {
                continue;
            };
            let report = manager.set_memory_limit(limit);
            self.collect_events(index); // evictions are events (R21)
            reports.push(report?);
        }
        Ok(reports)
    }

    /// Mapped memory of every rank, with the sum (`None` unless on elastic pages).
    pub fn xtensor_stats(&self) -> Option<(XTensorRankStats, Vec<XTensorRankStats>)> {
        if !self.is_elastic() {
            return None;
        }
        let ranks: Vec<_> = self
            .ranks
            .iter()
            .filter_map(|r| r.full.elastic_manager().map(XTensorRankStats::of))
            .collect();
        let mut total = XTensorRankStats::default();
        for r in &ranks {
            total.add(r);
        }
        Some((total, ranks))
    }
}
