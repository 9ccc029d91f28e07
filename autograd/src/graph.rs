//! The recorded graph: nodes (one per op application), edges to the nodes that produced each
//! input, leaves, and the grad-mode switch.

use std::cell::Cell;
use std::sync::{Arc, Mutex};

use crate::error::Result;
use crate::tensor::{LeafId, Tensor};

/// Where a gradient goes: output `slot` of `node`.
#[derive(Clone)]
pub struct Edge {
    pub(crate) node: Arc<Node>,
    pub(crate) slot: usize,
}

pub struct LeafState {
    pub(crate) id: LeafId,
    pub(crate) grad: Mutex<Option<Tensor>>,
}

/// Computes the gradients of an op's inputs from the gradients of its outputs (one per
/// output; `None` where no gradient reached that output).
pub(crate) type BackwardFn = dyn Fn(&[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> + Send + Sync;

pub(crate) enum NodeKind {
    /// An op. `None` once a backward without `retain_graph` freed its saved tensors.
    Op(Mutex<Option<Box<BackwardFn>>>),
    /// Accumulates into a leaf (locally into its `grad`, in a distributed pass into the context).
    Accumulate(Arc<LeafState>),
    /// Distributed: tensors this worker sent; gradients for them arrive from the receiver.
    Send(crate::dist::SendInfo),
    /// Distributed: tensors this worker received; their gradients go back to the sender.
    Recv(crate::dist::RecvInfo),
}

pub struct Node {
    pub(crate) name: &'static str,
    pub(crate) kind: NodeKind,
    /// One per input of the op: the edge its gradient follows (`None`: needs no gradient).
    pub(crate) next: Vec<Option<Edge>>,
    /// How many outputs (gradient slots) the node has.
    pub(crate) outputs: usize,
}

impl Node {
    pub(crate) fn new(name: &'static str, kind: NodeKind, next: Vec<Option<Edge>>, outputs: usize) -> Arc<Node> {
        Arc::new(Node {
            name,
            kind,
            next,
            outputs,
        })
    }

    pub fn name(&self) -> &'static str {
        self.name
    }
}

/// The edge a gradient for `t` follows, if `t` requires grad.
pub(crate) fn edge_of(t: &Tensor) -> Option<Edge> {
    use crate::tensor::GradMeta;
    match &t.inner.grad {
        None => None,
        Some(GradMeta::Output(e)) => Some(e.clone()),
        Some(GradMeta::Leaf(l)) => Some(Edge {
            node: Node::new("AccumulateGrad", NodeKind::Accumulate(l.clone()), Vec::new(), 1),
            slot: 0,
        }),
    }
}

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Runs `f` without recording operations (as the backward functions themselves run).
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    with_grad_mode(false, f)
}

/// Runs `f` recording operations, even inside a backward function (where recording is off).
pub fn enable_grad<R>(f: impl FnOnce() -> R) -> R {
    with_grad_mode(true, f)
}

/// Runs `f` with recording switched `on` or off, restoring the previous mode after (even if
/// `f` panics).
fn with_grad_mode<R>(on: bool, f: impl FnOnce() -> R) -> R {
    let previous = GRAD_ENABLED.with(|g| g.replace(on));
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            GRAD_ENABLED.with(|g| g.set(self.0));
        }
    }
    let _restore = Restore(previous);
    f()
}

/// Rematerialization (gradient checkpointing): runs `f` on `inputs` without recording, so none
/// of its intermediate tensors are kept, and records one node whose backward runs `f` again,
/// with recording, on fresh leaves holding the same values, back-propagates the incoming
/// gradient through that recomputation, and hands each input its gradient. Only the inputs
/// are kept between forward and backward. Pass parameters among the inputs (as
/// `Parameter::tensor()`): their gradients then reach wherever the pass accumulates (a
/// distributed context included). `f` must compute the same thing both times.
pub fn checkpoint(
    inputs: &[Tensor],
    f: impl Fn(&[Tensor]) -> Result<Tensor> + Send + Sync + 'static,
) -> Result<Tensor> {
    let out = no_grad(|| f(inputs))?;
    let saved: Vec<Tensor> = inputs.iter().map(Tensor::detach).collect();
    let refs: Vec<&Tensor> = inputs.iter().collect();
    Ok(record1("Checkpoint", &refs, out, move |g| {
        let leaves: Vec<Tensor> = saved.iter().map(|t| t.detach().requires_grad_()).collect();
        let y = enable_grad(|| f(&leaves))?;
        y.backward_with(Some(g.clone()), false)?;
        Ok(leaves.iter().map(Tensor::grad).collect())
    }))
}

/// Records `outputs` of an op on `inputs`: they become outputs of one new node whose backward
/// is `backward`. Nothing is recorded under `no_grad` or when no input requires grad.
pub(crate) fn record(
    name: &'static str,
    inputs: &[&Tensor],
    outputs: Vec<Tensor>,
    backward: impl Fn(&[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static,
) -> Vec<Tensor> {
    if !is_grad_enabled() || !inputs.iter().any(|t| t.requires_grad()) {
        return outputs;
    }
    let next = inputs.iter().map(|t| edge_of(t)).collect();
    let node = Node::new(
        name,
        NodeKind::Op(Mutex::new(Some(Box::new(backward)))),
        next,
        outputs.len(),
    );
    outputs
        .into_iter()
        .enumerate()
        .map(|(slot, t)| {
            t.with_edge(Edge {
                node: node.clone(),
                slot,
            })
        })
        .collect()
}

/// `record` for the common one-output case.
pub(crate) fn record1(
    name: &'static str,
    inputs: &[&Tensor],
    output: Tensor,
    backward: impl Fn(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static,
) -> Tensor {
    let n = inputs.len();
    record(name, inputs, vec![output], move |grads| match &grads[0] {
        Some(g) => backward(g),
        None => Ok(vec![None; n]),
    })
    .pop()
    .expect("one output")
}
