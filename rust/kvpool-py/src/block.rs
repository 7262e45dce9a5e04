//! `kvpool.Block` (R4) and the handle lists every manager binding takes and returns: all or
//! nothing, every item checked before any handle is taken.

use kvpool::{Block, BlockManager};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::convert;
use crate::errors::{type_error, value_error, IntoPyResult};

/// One handle of a physical KV block (R4).
#[pyclass(frozen, module = "kvpool", name = "Block")]
pub struct PyBlock {
    handle: Mutex<Option<Block>>,
    id: u32,
    block_size: usize,
}

impl PyBlock {
    pub(crate) fn new(block: Block) -> Self {
        Self {
            id: block.id(),
            block_size: block.block_size(),
            handle: Mutex::new(Some(block)),
        }
    }
}

#[pymethods]
impl PyBlock {
    /// Physical block id (never 0, the padding block).
    #[getter]
    fn id(&self) -> u32 {
        self.id
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.block_size
    }

    /// Handles of this block alive now, the prefix cache's included (0 once this one is released
    /// and the block went back to the free list).
    #[getter]
    fn ref_count(&self) -> u32 {
        self.handle.lock().as_ref().map_or(0, Block::ref_count)
    }

    /// The block's chained hash (16 bytes) while it is in the prefix cache, else None.
    #[getter]
    fn hash<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        let hash = self.handle.lock().as_ref().and_then(Block::hash)?;
        Some(PyBytes::new(py, &hash.to_bytes()))
    }

    /// Whether this handle was released (deallocate).
    #[getter]
    fn released(&self) -> bool {
        self.handle.lock().is_none()
    }

    fn __repr__(&self) -> String {
        match self.handle.lock().as_ref() {
            Some(b) => format!(
                "Block(id={}, ref_count={}, cached={})",
                self.id,
                b.ref_count(),
                b.is_cached()
            ),
            None => format!("Block(id={}, released)", self.id),
        }
    }

    fn __int__(&self) -> u32 {
        self.id
    }

    fn __index__(&self) -> u32 {
        self.id
    }
}

/// Takes the handles out of `blocks` (an iterable of `kvpool.Block`), all or nothing: every item
/// is checked (type, not released, not listed twice, accepted by `owns`) before any is taken.
pub(crate) fn take_handles(
    blocks: &Bound<'_, PyAny>,
    name: &str,
    owns: impl Fn(&Block) -> bool,
) -> PyResult<Vec<Block>> {
    let items: Vec<Bound<'_, PyBlock>> = blocks
        .try_iter()
        .map_err(|_| type_error(name, "must be an iterable of kvpool.Block"))?
        .map(|item| {
            let item = item?;
            item.cast_into::<PyBlock>().map_err(|e| {
                type_error(
                    name,
                    format!(
                        "must contain kvpool.Block, got {}",
                        e.into_inner().get_type()
                    ),
                )
            })
        })
        .collect::<PyResult<_>>()?;
    // The same object twice would lock its mutex twice: find repeats first (O(n log n)).
    let mut objects: Vec<(usize, u32)> = items
        .iter()
        .map(|i| (i.as_ptr() as usize, i.get().id))
        .collect();
    objects.sort_unstable();
    if let Some(pair) = objects.windows(2).find(|pair| pair[0].0 == pair[1].0) {
        return Err(value_error(
            name,
            format!("block {} is listed twice", pair[0].1),
        ));
    }
    let mut guards = Vec::with_capacity(items.len());
    for item in &items {
        let guard = item.get().handle.lock();
        match guard.as_ref() {
            None => {
                return Err(value_error(
                    name,
                    format!("block {} was already released", item.get().id),
                ))
            }
            Some(block) if !owns(block) => {
                return Err(value_error(
                    name,
                    format!("block {} belongs to another manager", block.id()),
                ))
            }
            Some(_) => {}
        }
        guards.push(guard);
    }
    Ok(guards
        .into_iter()
        .map(|mut g| g.take().expect("checked above"))
        .collect())
}

/// Clones the handles out of `blocks` without releasing them.
pub(crate) fn borrow_handles(
    blocks: &Bound<'_, PyAny>,
    name: &str,
    owns: impl Fn(&Block) -> bool,
) -> PyResult<Vec<Block>> {
    let mut out = Vec::new();
    for item in blocks
        .try_iter()
        .map_err(|_| type_error(name, "must be an iterable of kvpool.Block"))?
    {
        let item = item?;
        let block = item.cast::<PyBlock>().map_err(|_| {
            type_error(
                name,
                format!("must contain kvpool.Block, got {}", item.get_type()),
            )
        })?;
        let guard = block.get().handle.lock();
        let handle = guard.as_ref().ok_or_else(|| {
            value_error(
                name,
                format!("block {} was already released", block.get().id),
            )
        })?;
        if !owns(handle) {
            return Err(value_error(
                name,
                format!("block {} belongs to another manager", handle.id()),
            ));
        }
        out.push(handle.clone());
    }
    Ok(out)
}

pub(crate) fn blocks_to_list(py: Python<'_>, blocks: Vec<Block>) -> PyResult<Bound<'_, PyList>> {
    let objects = blocks
        .into_iter()
        .map(|b| Bound::new(py, PyBlock::new(b)))
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, objects)
}

/// `allocate(n)` of either manager, as a list of `kvpool.Block`.
pub(crate) fn allocate_list<'py, M: BlockManager>(
    py: Python<'py>,
    manager: &Mutex<M>,
    n: &Bound<'_, PyAny>,
) -> PyResult<Bound<'py, PyList>> {
    let n = convert::count(n, "n")?;
    let blocks = manager.lock().allocate(n).py()?;
    blocks_to_list(py, blocks)
}

/// `deallocate(blocks)` of either manager: all handles checked before any is released.
pub(crate) fn deallocate_list<M: BlockManager>(
    manager: &Mutex<M>,
    blocks: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let mut manager = manager.lock();
    let handles = take_handles(blocks, "blocks", |b| manager.owns(b))?;
    manager.deallocate(handles).py()
}
