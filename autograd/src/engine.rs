//! The local engine: runs a backward pass from a set of starting nodes in topological order,
//! summing the gradients that reach each node before running it.
//!
//! A pass counts, for every node reachable from its starts, how many edges lead into it; a node
//! runs once all of them have delivered (or passed on nothing). Leaves and the distributed
//! nodes are handed to a [`Sink`]: a local backward accumulates into `Tensor::grad`, a
//! distributed one into its context and over RPC.

use std::collections::HashMap;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::graph::{no_grad, LeafState, Node, NodeKind};
use crate::tensor::Tensor;

pub(crate) trait Sink {
    fn accumulate(&self, leaf: &Arc<LeafState>, grad: Tensor) -> Result<()>;
    /// A received tensor's gradient: send it back to where the tensor came from.
    fn recv(&self, node: &Node, info: &crate::dist::RecvInfo, grads: Vec<Option<Tensor>>) -> Result<()>;
}

/// Adds two gradients of one tensor (dense or sparse rows, in any combination).
pub(crate) fn add_grads(a: Tensor, b: Tensor) -> Result<Tensor> {
    // Gradients of one tensor that arrived on different devices meet on the first's.
    let b = if b.device() != a.device() && !b.is_sparse() {
        crate::cuda::to_device(&b, a.device())?
    } else {
        b
    };
    match (a.is_sparse(), b.is_sparse()) {
        (false, false) => crate::cpu::binary_add(&a, &b),
        (true, true) => {
            let mut indices = a.sparse_indices().unwrap_or_default().to_vec();
            indices.extend_from_slice(b.sparse_indices().unwrap_or_default());
            let rows = crate::cpu::cat_raw(&[a.sparse_values(), b.sparse_values()], 0)?;
            Tensor::sparse_rows(indices, rows, a.shape().to_vec())
        }
        (false, true) => crate::cpu::index_add_rows(&a, b.sparse_indices().unwrap_or_default(), &b.sparse_values()),
        (true, false) => crate::cpu::index_add_rows(&b, a.sparse_indices().unwrap_or_default(), &a.sparse_values()),
    }
}

fn add_into(slot: &mut Option<Tensor>, g: Tensor) -> Result<()> {
    *slot = Some(match slot.take() {
        None => g,
        Some(prev) => add_grads(prev, g)?,
    });
    Ok(())
}

fn key(n: &Arc<Node>) -> usize {
    Arc::as_ptr(n) as usize
}

/// Runs one pass. `keep_graph = false` frees each op's saved tensors after it runs.
pub(crate) fn run(starts: Vec<(Arc<Node>, Vec<Option<Tensor>>)>, sink: &dyn Sink, keep_graph: bool) -> Result<()> {
    no_grad(|| run_inner(starts, sink, keep_graph))
}

fn run_inner(starts: Vec<(Arc<Node>, Vec<Option<Tensor>>)>, sink: &dyn Sink, keep_graph: bool) -> Result<()> {
    // Dependencies: edges into each reachable node.
    let mut deps: HashMap<usize, usize> = HashMap::new();
    let mut nodes: HashMap<usize, Arc<Node>> = HashMap::new();
    let mut stack: Vec<Arc<Node>> = Vec::new();
    for (n, _) in &starts {
        if nodes.insert(key(n), n.clone()).is_none() {
            stack.push(n.clone());
        }
    }
    while let Some(n) = stack.pop() {
        for e in n.next.iter().flatten() {
            *deps.entry(key(&e.node)).or_default() += 1;
            if nodes.insert(key(&e.node), e.node.clone()).is_none() {
                stack.push(e.node.clone());
            }
        }
    }
    let mut buffers: HashMap<usize, Vec<Option<Tensor>>> = HashMap::new();
    for (n, grads) in starts {
        let buf = buffers.entry(key(&n)).or_insert_with(|| vec![None; n.outputs]);
        for (slot, g) in grads.into_iter().enumerate() {
            if let Some(g) = g {
                if slot >= buf.len() {
                    return Err(Error::Backward(format!(
                        "{} has {} outputs, got gradient {slot}",
                        n.name, n.outputs
                    )));
                }
                add_into(&mut buf[slot], g)?;
            }
        }
    }
    let mut ready: Vec<Arc<Node>> = nodes
        .values()
        .filter(|n| !deps.contains_key(&key(n)))
        .cloned()
        .collect();
    while let Some(node) = ready.pop() {
        let grads = buffers.remove(&key(&node)).unwrap_or_else(|| vec![None; node.outputs]);
        let has_grad = grads.iter().any(Option::is_some);
        let outputs: Vec<Option<Tensor>> = if !has_grad {
            vec![None; node.next.len()]
        } else {
            match &node.kind {
                NodeKind::Op(f) => {
                    let mut guard = f.lock().unwrap();
                    let Some(backward) = guard.as_ref() else {
                        return Err(Error::GraphFreed(node.name));
                    };
                    let out = backward(&grads)?;
                    if !keep_graph {
                        *guard = None;
                    }
                    if out.len() != node.next.len() {
                        return Err(Error::Backward(format!(
                            "{} returned {} gradients for {} inputs",
                            node.name,
                            out.len(),
                            node.next.len()
                        )));
                    }
                    out
                }
                NodeKind::Accumulate(leaf) => {
                    if let Some(g) = grads.into_iter().next().flatten() {
                        sink.accumulate(leaf, g)?;
                    }
                    Vec::new()
                }
                NodeKind::Send(info) => {
                    info.received.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    grads
                }
                NodeKind::Recv(info) => {
                    sink.recv(&node, info, grads)?;
                    Vec::new()
                }
            }
        };
        for (edge, g) in node.next.iter().zip(outputs) {
            let Some(edge) = edge else { continue };
            let k = key(&edge.node);
            if let Some(g) = g {
                let buf = buffers.entry(k).or_insert_with(|| vec![None; edge.node.outputs]);
                add_into(&mut buf[edge.slot], g)?;
            }
            let d = deps.get_mut(&k).expect("counted");
            *d -= 1;
            if *d == 0 {
                ready.push(edge.node.clone());
            }
        }
    }
    Ok(())
}

struct LocalSink;

impl Sink for LocalSink {
    fn accumulate(&self, leaf: &Arc<LeafState>, grad: Tensor) -> Result<()> {
        let mut slot = leaf.grad.lock().unwrap();
        add_into(&mut slot, grad)
    }

    fn recv(&self, node: &Node, _: &crate::dist::RecvInfo, _: Vec<Option<Tensor>>) -> Result<()> {
        Err(Error::Backward(format!(
            "the graph reaches {} (a tensor received over RPC): use dist::backward inside its context",
            node.name
        )))
    }
}

impl Tensor {
    /// Backward from this one-element tensor: accumulates d(self)/d(leaf) into every leaf's
    /// `grad`, then frees the graph.
    pub fn backward(&self) -> Result<()> {
        self.backward_with(None, false)
    }

    /// Backward with an explicit output gradient (`None`: ones, for a one-element tensor) and
    /// the choice to keep the graph for another backward.
    pub fn backward_with(&self, grad: Option<Tensor>, retain_graph: bool) -> Result<()> {
        let starts = vec![root_start(self, grad)?];
        run(starts, &LocalSink, retain_graph)
    }
}

/// The starting point of a backward from `root`.
pub(crate) fn root_start(root: &Tensor, grad: Option<Tensor>) -> Result<(Arc<Node>, Vec<Option<Tensor>>)> {
    let grad = match grad {
        Some(g) => {
            if g.shape() != root.shape() {
                return Err(Error::Backward(format!(
                    "gradient of shape {:?} for a root of shape {:?}",
                    g.shape(),
                    root.shape()
                )));
            }
            g
        }
        None => {
            if root.numel() != 1 {
                return Err(Error::Backward(format!(
                    "root of shape {:?} is not a scalar; all roots need to be scalar (or pass a gradient)",
                    root.shape()
                )));
            }
            // On the root's device: a seed left on the CPU would carry a GPU graph's whole
            // backward to the CPU (or stop it at the first op that needs both on one device).
            Tensor::ones(root.shape(), root.dtype())?.to_device(root.device())?
        }
    };
    let Some(edge) = crate::graph::edge_of(root) else {
        return Err(Error::Backward("requires_grad not set on root".into()));
    };
    let mut grads = vec![None; edge.node.outputs];
    grads[edge.slot] = Some(grad);
    Ok((edge.node, grads))
}
