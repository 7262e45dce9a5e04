//! `kvpool.SlidingWindowBlockManager` and `kvpool.CompositeBlockManager` (R25). Each method
//! validates, makes one core call and maps the error.

use kvpool::{BlockManager, CompositeBlockManager, GroupSpec, SlidingWindowBlockManager};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::block::{allocate_list, blocks_to_list, deallocate_list, take_handles};
use crate::convert;
use crate::errors::{type_error, value_error, IntoPyResult};
use crate::stats::counts_dict;

/// Block allocator of a sliding-window group (R25): blocks whose tokens all lie before
/// num_computed_tokens - window + 1 can be released.
#[pyclass(frozen, module = "kvpool", name = "SlidingWindowBlockManager")]
pub struct PySlidingWindowBlockManager {
    inner: Mutex<SlidingWindowBlockManager>,
    num_blocks: usize,
}

#[pymethods]
impl PySlidingWindowBlockManager {
    #[new]
    fn new(
        num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        window: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let num_blocks = convert::count(num_blocks, "num_blocks")?;
        let block_size = convert::count(block_size, "block_size")?;
        let window = convert::count(window, "window")?;
        Ok(Self {
            inner: Mutex::new(
                SlidingWindowBlockManager::new(num_blocks, block_size, window, false).py()?,
            ),
            num_blocks,
        })
    }
    /// Ids in the pool, padding id 0 included.
    #[getter]
    fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.lock().block_size()
    }
    /// The window, in tokens.
    #[getter]
    fn window(&self) -> usize {
        self.inner.lock().window()
    }
    #[getter]
    fn num_total_blocks(&self) -> usize {
        self.inner.lock().counts().total
    }
    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.inner.lock().counts().free
    }
    #[getter]
    fn num_used_blocks(&self) -> usize {
        self.inner.lock().counts().used
    }
    /// Index of the first block the query at position num_computed_tokens can attend to; the
    /// blocks before it can be released.
    fn first_needed_block(&self, num_computed_tokens: &Bound<'_, PyAny>) -> PyResult<usize> {
        let n = convert::count(num_computed_tokens, "num_computed_tokens")?;
        Ok(self.inner.lock().first_needed_block(n))
    }
    /// n fresh blocks; OutOfBlocksError if fewer are free, changing nothing.
    fn allocate<'py>(&self, py: Python<'py>, n: &Bound<'_, PyAny>) -> PyResult<Bound<'py, PyList>> {
        allocate_list(py, &self.inner, n)
    }
    /// Releases these handles; a released handle again is a ValueError.
    fn deallocate(&self, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        deallocate_list(&self.inner, blocks)
    }
    /// Walks every structure; raises InvariantError if a rule is broken.
    fn check(&self) -> PyResult<()> {
        self.inner.lock().check().py()
    }
    fn __repr__(&self) -> String {
        let m = self.inner.lock();
        let c = m.counts();
        format!(
            "SlidingWindowBlockManager(num_blocks={}, block_size={}, window={}, free={}, used={})",
            self.num_blocks,
            m.block_size(),
            m.window(),
            c.free,
            c.used
        )
    }
}

/// Several block groups in one manager (R25), each with its own ids and block size: full
/// attention groups keep their blocks, sliding-window groups release the ones behind the window.
#[pyclass(frozen, module = "kvpool", name = "CompositeBlockManager")]
pub struct PyCompositeBlockManager {
    inner: Mutex<CompositeBlockManager>,
}

fn group_arg(group: &Bound<'_, PyAny>, num_groups: usize) -> PyResult<usize> {
    let g = convert::count(group, "group")?;
    if g >= num_groups {
        return Err(value_error(
            "group",
            format!("must be < {num_groups}, got {g}"),
        ));
    }
    Ok(g)
}

#[pymethods]
impl PyCompositeBlockManager {
    /// `groups`: a list of `(num_blocks, block_size, window)` tuples, window None for full
    /// attention.
    #[new]
    fn new(groups: &Bound<'_, PyAny>) -> PyResult<Self> {
        let mut specs = Vec::new();
        for item in groups.try_iter().map_err(|_| {
            type_error(
                "groups",
                "must be a list of (num_blocks, block_size, window)",
            )
        })? {
            let item = item?;
            let (num_blocks, block_size, window): (
                Bound<'_, PyAny>,
                Bound<'_, PyAny>,
                Bound<'_, PyAny>,
            ) = item.extract().map_err(|_| {
                type_error(
                    "groups",
                    "each group must be a (num_blocks, block_size, window) tuple",
                )
            })?;
            specs.push(GroupSpec {
                num_blocks: convert::count(&num_blocks, "groups")?,
                block_size: convert::count(&block_size, "groups")?,
                window: convert::optional_count(Some(&window), "groups")?,
            });
        }
        Ok(Self {
            inner: Mutex::new(CompositeBlockManager::new(&specs).py()?),
        })
    }
    /// Number of groups.
    #[getter]
    fn num_groups(&self) -> usize {
        self.inner.lock().num_groups()
    }
    /// Tokens per block of group g.
    fn block_size(&self, group: &Bound<'_, PyAny>) -> PyResult<usize> {
        let m = self.inner.lock();
        let g = group_arg(group, m.num_groups())?;
        Ok(m.group(g).py()?.as_manager().block_size())
    }
    /// Sliding window of group g in tokens, None for full attention.
    fn window(&self, group: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
        let m = self.inner.lock();
        let g = group_arg(group, m.num_groups())?;
        Ok(m.group(g).py()?.window())
    }
    /// Block counts of group g as a dict.
    fn counts<'py>(
        &self,
        py: Python<'py>,
        group: &Bound<'_, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let counts = {
            let m = self.inner.lock();
            let g = group_arg(group, m.num_groups())?;
            m.counts(g).py()?
        };
        counts_dict(py, &counts)
    }
    /// n fresh blocks of group g; OutOfBlocksError if fewer are free, changing nothing.
    fn allocate<'py>(
        &self,
        py: Python<'py>,
        group: &Bound<'_, PyAny>,
        n: &Bound<'_, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let n = convert::count(n, "n")?;
        let blocks = {
            let mut m = self.inner.lock();
            let g = group_arg(group, m.num_groups())?;
            m.group_mut(g).py()?.as_manager_mut().allocate(n).py()?
        };
        blocks_to_list(py, blocks)
    }
    /// Releases these handles (of any group); a released handle again is a ValueError.
    fn deallocate(&self, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let m = self.inner.lock();
        let handles = take_handles(blocks, "blocks", |b| m.owner_of(b).is_some())?;
        drop(handles);
        Ok(())
    }
    /// Walks every group; raises InvariantError if a rule is broken.
    fn check(&self) -> PyResult<()> {
        self.inner.lock().check().py()
    }
    fn __repr__(&self) -> String {
        format!("CompositeBlockManager(num_groups={})", self.num_groups())
    }
}
