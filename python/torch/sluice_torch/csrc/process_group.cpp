// Sluice as a torch.distributed process group: a c10d::Backend ("sluice") whose collectives run
// on a Sluice collective group (libsluice_c's sluice_group_*), for DDP, FSDP on CPU and plain
// torch.distributed programs.
//
// Shape:
// - Formation: each rank binds a group listener, publishes its address in the process group's
//   own store (already namespaced per group by torch's PrefixStore), reads every other rank's,
//   and forms the Sluice group from them.
// - Every operation borrows the caller's tensors in place (CPU, dense, contiguous: anything
//   else is a clear error at the call, never a hang) and returns a SluiceWork at once. The
//   library calls back on its own threads; those only count parts down and hand the finish to
//   one completion thread, which copies out where an operation needed a flat temporary,
//   completes the Work and its future (with the tensors, or an error naming the rank), and so
//   runs DDP's future callbacks off the library's threads.
// - Errors raise in wait() and in the future; the group's timeout bounds every wait inside the
//   library, so a rank that never calls an operation is an error on the others, not a hang.

#include <ATen/DLConvertor.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>

#include <pybind11/chrono.h>

#include "sluice.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace sluice_torch {

using c10d::Work;

namespace {

std::string groupError(int status) {
  const char* e = sluice_last_error();
  std::string s = (e && *e) ? e : "";
  return std::string(sluice_status_name(status)) + (s.empty() ? "" : ": " + s);
}

// Whether Python is shutting down (then what holds tensors is leaked, not freed: freeing a
// tensor whose Python object is gone takes the GIL, which ends a thread mid-destructor while
// Python finalizes, and that terminates the process).
bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return !Py_IsInitialized() || Py_IsFinalizing();
#else
  return !Py_IsInitialized() || _Py_IsFinalizing();
#endif
}

// One thread that finishes operations (copies out, completes Works and futures), so that
// callbacks chained on a Work's future never run on the library's threads. Made on first use and
// never destroyed (it may still run while the process exits).
class Completer {
 public:
  static Completer& get() {
    static Completer* c = new Completer();
    return *c;
  }

  void post(std::function<void()> f) {
    {
      std::lock_guard<std::mutex> g(mu_);
      queue_.push_back(std::move(f));
    }
    cv_.notify_one();
  }

 private:
  Completer() {
    std::thread([this] {
      for (;;) {
        std::function<void()> f;
        {
          std::unique_lock<std::mutex> g(mu_);
          cv_.wait(g, [this] { return !queue_.empty(); });
          f = std::move(queue_.front());
          queue_.pop_front();
        }
        try {
          f();
        } catch (const std::exception& e) {
          // A callback chained on a future threw: it must not end this thread (and the process).
          TORCH_WARN("sluice: a completion callback threw: ", e.what());
        }
      }
    }).detach();
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
};

// Finished Works the completion thread let go of. They hold tensors, and the last reference
// to a tensor whose Python object is gone takes the GIL to free it: not on our threads (a stall
// behind Python, or a crash while Python exits), but on the next caller's thread, which
// empties this whenever it starts an operation (and the backend when it is destroyed).
class Graveyard {
 public:
  static Graveyard& get() {
    static Graveyard* g = new Graveyard();
    return *g;
  }

  template <class T>
  void bury(T&& x) {
    std::lock_guard<std::mutex> g(mu_);
    dead_.emplace_back(std::make_shared<std::decay_t<T>>(std::forward<T>(x)));
  }

  void empty() {
    std::vector<std::shared_ptr<void>> dead;
    {
      std::lock_guard<std::mutex> g(mu_);
      dead.swap(dead_);
    }
    if (finalizing()) {
      new std::vector<std::shared_ptr<void>>(std::move(dead));  // leaked on purpose
    }
  }

 private:
  std::mutex mu_;
  std::vector<std::shared_ptr<void>> dead_;
};

}  // namespace

// One operation: `parts` library calls, then an optional copy-out, then the Work and its
// future complete with `outputs` or with the first part's error.
class SluiceWork : public c10d::Work {
 public:
  SluiceWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
      : Work(rank, type),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

  std::vector<at::Tensor> result() override { return outputs_; }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

  // Complete once the future is too (the Work finishes first, so a future callback that waits
  // on its own Work returns; wait() then waits the moment until the future holds its value).
  bool isCompleted() override { return Work::isCompleted() && future_->completed(); }

  bool wait(std::chrono::milliseconds timeout) override {
    bool done = Work::wait(timeout);
    future_->wait();
    return done;
  }

  // The caller's tensors the operation reads or writes, kept alive until it ends (and freed
  // with the Work: see Graveyard).
  void keep(const at::Tensor& t) { kept_.push_back(t); }

  // A temporary of our own (no Python object), freed as soon as the operation ends.
  void temp(const at::Tensor& t) { temps_.push_back(t); }

  // Runs on the completion thread before the Work completes, if every part succeeded.
  void after(std::function<void()> f) { after_ = std::move(f); }

  // Starts one part: `start(done, user)` calls the library; its error throws here (and any
  // parts already started still finish the Work).
  void part(const std::function<int(sluice_done_fn, void*)>& start) {
    pending_.fetch_add(1);
    c10::intrusive_ptr<SluiceWork> self = c10::intrusive_ptr<SluiceWork>::reclaim_copy(this);
    void* user = self.release();
    int rc;
    try {
      rc = start(&SluiceWork::onDone, user);
    } catch (...) {
      // Thrown before the library took `user` (an argument torch could not describe).
      c10::intrusive_ptr<SluiceWork>::reclaim(static_cast<SluiceWork*>(user))->partDone("not started");
      throw;
    }
    if (rc != SLUICE_OK) {
      std::string why = groupError(rc);
      // The library did not take `user`: take it back and count this part as failed.
      c10::intrusive_ptr<SluiceWork> back = c10::intrusive_ptr<SluiceWork>::reclaim(static_cast<SluiceWork*>(user));
      back->partDone(why);
      TORCH_CHECK(false, "sluice: ", why);
    }
  }

  // Called once every part has been started: the Work may finish from here on.
  void started() { partDone(""); }

 private:
  // On a library thread: everything, the reference this part held included, moves to the
  // completion thread.
  static void onDone(int status, void* user) {
    auto error = status == SLUICE_OK ? std::string() : groupError(status);
    auto self = c10::intrusive_ptr<SluiceWork>::reclaim(static_cast<SluiceWork*>(user));
    Completer::get().post([self = std::move(self), error = std::move(error)]() mutable {
      self->partDone(error);
      Graveyard::get().bury(std::move(self));
    });
  }

  void partDone(const std::string& error) {
    if (!error.empty()) {
      std::lock_guard<std::mutex> g(errorMu_);
      if (error_.empty()) {
        error_ = error;
      }
    }
    // `pending_` starts at 1 for the starter (released by started()). Parts end on the
    // completion thread; the starter's end may come on the caller's thread, and posts.
    if (pending_.fetch_sub(1) == 1) {
      auto self = c10::intrusive_ptr<SluiceWork>::reclaim_copy(this);
      Completer::get().post([self = std::move(self)]() mutable {
        self->complete();
        Graveyard::get().bury(std::move(self));
      });
    }
  }

  void complete() {
    std::string error;
    {
      std::lock_guard<std::mutex> g(errorMu_);
      error = error_;
    }
    if (error.empty() && after_) {
      // With the caller's thread-local state (inference mode, grad mode) for the copies.
      at::ThreadLocalStateGuard tls(tls_);
      try {
        after_();
      } catch (const std::exception& e) {
        error = std::string("copying the result out: ") + e.what();
      }
    }
    // Ours, without Python objects: freed here, on this thread (the caller's tensors the copy-out
    // held are also the Work's outputs, which go with the Work).
    after_ = nullptr;
    temps_.clear();
    if (error.empty()) {
      finish();
      future_->markCompleted(c10::IValue(outputs_));
    } else {
      auto e = std::make_exception_ptr(std::runtime_error("sluice: " + error));
      finish(e);
      future_->setError(e);
    }
  }

  // Dropped with the Work (see Graveyard), never on the completion thread.
  std::vector<at::Tensor> outputs_;
  std::vector<at::Tensor> kept_;
  std::vector<at::Tensor> temps_;
  at::ThreadLocalState tls_;  // the caller's, captured when the Work is made
  std::function<void()> after_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::atomic<int64_t> pending_{1};
  std::mutex errorMu_;
  std::string error_;
};

class SluiceBackend : public c10d::Backend {
 public:
  SluiceBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout,
                const std::string& name, const std::string& host)
      : Backend(rank, size), timeout_(timeout) {
    TORCH_CHECK(size > 0 && rank >= 0 && rank < size, "sluice: rank ", rank, " in a world of ", size);
    check(sluice_context_new(nullptr, nullptr, &ctx_), "making a context");
    sluice_group_bound* bound = nullptr;
    int bindRc = sluice_group_bind(ctx_, host.c_str(), &bound);
    if (bindRc != SLUICE_OK) {
      std::string why = groupError(bindRc);
      sluice_context_free(ctx_);
      TORCH_CHECK(false, "sluice: binding on ", host, ": ", why);
    }
    std::string mine = sluice_group_bound_address(bound);
    const std::string prefix = "sluice/addr/";
    std::vector<std::string> addresses(size);
    try {
      store->set(prefix + std::to_string(rank), std::vector<uint8_t>(mine.begin(), mine.end()));
      for (int r = 0; r < size; r++) {
        if (r != rank) {
          auto got = store->get(prefix + std::to_string(r));
          addresses[r] = std::string(got.begin(), got.end());
        }
      }
    } catch (...) {
      sluice_group_bound_free(bound);
      sluice_context_free(ctx_);
      throw;
    }
    std::vector<const char*> ptrs;
    for (auto& a : addresses) {
      ptrs.push_back(a.c_str());
    }
    int rc = sluice_group_form(bound, name.c_str(), rank, size, ptrs.data(), timeout.count(), &group_);
    if (rc != SLUICE_OK) {
      std::string why = groupError(rc);
      sluice_context_free(ctx_);
      TORCH_CHECK(false, "sluice: forming group ", name, " (rank ", rank, " of ", size, "): ", why);
    }
  }

  ~SluiceBackend() override {
    sluice_group_free(group_);
    sluice_context_free(ctx_);
    Graveyard::get().empty();
  }

  const std::string getBackendName() const override { return "sluice"; }

  c10::intrusive_ptr<Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override {
    auto& t = one(tensors, "broadcast");
    auto root = checkedRoot(opts.rootRank);
    return run(c10d::OpType::BROADCAST, tensors, [&](SluiceWork& w) {
      w.part([&](sluice_done_fn d, void* u) { return sluice_group_broadcast(group_, root, t.data_ptr(), t.nbytes(), d, u); });
    });
  }

  c10::intrusive_ptr<Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override {
    return allreduceAll(tensors, opts.reduceOp, c10d::OpType::ALLREDUCE);
  }

  c10::intrusive_ptr<Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                               const c10d::AllreduceCoalescedOptions& opts) override {
    return allreduceAll(tensors, opts.reduceOp, c10d::OpType::ALLREDUCE_COALESCED);
  }

  c10::intrusive_ptr<Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    auto& t = one(tensors, "reduce");
    auto root = checkedRoot(opts.rootRank);
    int op = reduceOp(opts.reduceOp, "reduce");
    floatingForAvg(opts.reduceOp, t, "reduce");
    return run(c10d::OpType::REDUCE, tensors, [&](SluiceWork& w) {
      w.part([&](sluice_done_fn d, void* u) {
        return sluice_group_reduce(group_, root, t.data_ptr(), t.nbytes(), dtype(t), op, d, u);
      });
    });
  }

  c10::intrusive_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                     const c10d::AllgatherOptions&) override {
    auto& in = one(inputs, "allgather");
    TORCH_CHECK(outputs.size() == 1, "sluice: allgather takes one output list (got ", outputs.size(), ")");
    auto& outs = outputs[0];
    sameEach(outs, in, getSize(), "allgather");
    auto flat = at::empty({static_cast<int64_t>(getSize()) * in.numel()}, in.options());
    return run(c10d::OpType::ALLGATHER, outs, [&](SluiceWork& w) {
      w.keep(in);
      w.temp(flat);
      w.after([flat, outs, n = in.numel()]() mutable { unflatten(flat, outs, n); });
      w.part([&](sluice_done_fn d, void* u) {
        return sluice_group_all_gather(group_, in.data_ptr(), in.nbytes(), flat.data_ptr(), flat.nbytes(), d, u);
      });
    });
  }

  c10::intrusive_ptr<Work> all_gather_single(at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions&) override {
    dense(in, "all_gather_into_tensor input");
    dense(out, "all_gather_into_tensor output");
    sameType(out, in, "all_gather_into_tensor");
    TORCH_CHECK(out.numel() == in.numel() * getSize(), "sluice: all_gather_into_tensor output has ", out.numel(),
                " elements for an input of ", in.numel(), " over ", getSize(), " ranks");
    std::vector<at::Tensor> outs{out};
    return run(c10d::OpType::_ALLGATHER_BASE, outs, [&](SluiceWork& w) {
      w.keep(in);
      w.part([&](sluice_done_fn d, void* u) {
        return sluice_group_all_gather(group_, in.data_ptr(), in.nbytes(), out.data_ptr(), out.nbytes(), d, u);
      });
    });
  }

  c10::intrusive_ptr<Work> all_gather_single_coalesced(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
                                                       const c10d::AllgatherOptions&) override {
    TORCH_CHECK(outs.size() == ins.size(), "sluice: ", outs.size(), " outputs for ", ins.size(), " inputs");
    for (size_t i = 0; i < ins.size(); i++) {
      dense(ins[i], "allgather input");
      dense(outs[i], "allgather output");
      sameType(outs[i], ins[i], "allgather");
      TORCH_CHECK(outs[i].numel() == ins[i].numel() * getSize(), "sluice: allgather output ", i, " has ",
                  outs[i].numel(), " elements for an input of ", ins[i].numel(), " over ", getSize(), " ranks");
    }
    disjoint(outs, ins, "allgather");
    return run(c10d::OpType::ALLGATHER_INTO_TENSOR_COALESCED, outs, [&](SluiceWork& w) {
      for (size_t i = 0; i < ins.size(); i++) {
        w.keep(ins[i]);
        w.part([&](sluice_done_fn d, void* u) {
          return sluice_group_all_gather(group_, ins[i].data_ptr(), ins[i].nbytes(), outs[i].data_ptr(),
                                         outs[i].nbytes(), d, u);
        });
      }
    });
  }

  c10::intrusive_ptr<Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                  const c10d::GatherOptions& opts) override {
    auto& in = one(inputs, "gather");
    auto root = checkedRoot(opts.rootRank);
    bool isRoot = static_cast<int>(root) == getRank();
    std::vector<at::Tensor> outs;
    if (isRoot) {
      TORCH_CHECK(outputs.size() == 1, "sluice: gather takes one output list on the root (got ", outputs.size(), ")");
      outs = outputs[0];
      sameEach(outs, in, getSize(), "gather");
    } else {
      TORCH_CHECK(outputs.empty(), "sluice: gather takes no outputs on a rank that is not the root");
    }
    auto flat = isRoot ? at::empty({static_cast<int64_t>(getSize()) * in.numel()}, in.options()) : at::Tensor();
    return run(c10d::OpType::GATHER, outs, [&](SluiceWork& w) {
      w.keep(in);
      if (isRoot) {
        w.temp(flat);
        w.after([flat, outs, n = in.numel()]() mutable { unflatten(flat, outs, n); });
      }
      w.part([&](sluice_done_fn d, void* u) {
        return sluice_group_gather(group_, root, in.data_ptr(), in.nbytes(), isRoot ? flat.data_ptr() : nullptr,
                                   isRoot ? flat.nbytes() : 0, d, u);
      });
    });
  }

  c10::intrusive_ptr<Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                   const c10d::ScatterOptions& opts) override {
    auto& out = one(outputs, "scatter");
    auto root = checkedRoot(opts.rootRank);
    bool isRoot = static_cast<int>(root) == getRank();
    at::Tensor flat;
    if (isRoot) {
      TORCH_CHECK(inputs.size() == 1, "sluice: scatter takes one input list on the root (got ", inputs.size(), ")");
      sameEach(inputs[0], out, getSize(), "scatter");
      flat = flatten(inputs[0]);
    } else {
      TORCH_CHECK(inputs.empty(), "sluice: scatter takes no inputs on a rank that is not the root");
    }
    return run(c10d::OpType::SCATTER, outputs, [&](SluiceWork& w) {
      if (isRoot) {
        w.temp(flat);
      }
      w.part([&](sluice_done_fn d, void* u) {
        return sluice_group_scatter(group_, root, isRoot ? flat.data_ptr() : nullptr, isRoot ? flat.nbytes() : 0,
                                    out.data_ptr(), out.nbytes(), d, u);
      });
    });
  }

  c10::intrusive_ptr<Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                          std::vector<std::vector<at::Tensor>>& inputs,
                                          const c10d::ReduceScatterOptions& opts) override {
    auto& out = one(outputs, "reduce_scatter");
    floatingForAvg(opts.reduceOp, out, "reduce_scatter");
    TORCH_CHECK(inputs.size() == 1, "sluice: reduce_scatter takes one input list (got ", inputs.size(), ")");
    sameEach(inputs[0], out, getSize(), "reduce_scatter");
    int op = reduceOp(opts.reduceOp, "reduce_scatter");
    auto flat = flatten(inputs[0]);
    return run(c10d::OpType::REDUCE_SCATTER, outputs, [&](SluiceWork& w) {
      w.temp(flat);
      w.part([&](sluice_done_fn d, void* u) {
        return sluice_group_reduce_scatter(group_, flat.data_ptr(), flat.nbytes(), out.data_ptr(), out.nbytes(),
                                           dtype(out), op, d, u);
      });
    });
  }

  c10::intrusive_ptr<Work> reduce_scatter_single(at::Tensor& out, at::Tensor& in,
                                                 const c10d::ReduceScatterOptions& opts) override {
    std::vector<at::Tensor> outs{out}, ins{in};
    return reduceScatterAll(outs, ins, opts, c10d::OpType::_REDUCE_SCATTER_BASE);
  }

  c10::intrusive_ptr<Work> reduce_scatter_single_coalesced(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
                                                           const c10d::ReduceScatterOptions& opts) override {
    return reduceScatterAll(outs, ins, opts, c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED);
  }

  c10::intrusive_ptr<Work> all_to_all_single(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& outSplits,
                                             std::vector<int64_t>& inSplits, const c10d::AllToAllOptions&) override {
    dense(in, "all_to_all_single input");
    dense(out, "all_to_all_single output");
    sameType(out, in, "all_to_all_single");
    auto inLens = splitBytes(in, inSplits, "input");
    auto outLens = splitBytes(out, outSplits, "output");
    std::vector<at::Tensor> outs{out};
    return run(c10d::OpType::ALLTOALL_BASE, outs, [&](SluiceWork& w) {
      w.keep(in);
      w.part([&](sluice_done_fn d, void* u) {
        return sluice_group_all_to_all(group_, in.data_ptr(), in.nbytes(), inLens.data(), out.data_ptr(),
                                       out.nbytes(), outLens.data(), d, u);
      });
    });
  }

  c10::intrusive_ptr<Work> alltoall(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
                                    const c10d::AllToAllOptions&) override {
    TORCH_CHECK(static_cast<int>(ins.size()) == getSize() && static_cast<int>(outs.size()) == getSize(),
                "sluice: all_to_all takes one input and one output per rank (", getSize(), "), got ", ins.size(),
                " and ", outs.size());
    std::vector<size_t> inLens, outLens;
    for (int r = 0; r < getSize(); r++) {
      dense(ins[r], "all_to_all input");
      dense(outs[r], "all_to_all output");
      sameType(outs[r], ins[r], "all_to_all");
      sameType(ins[r], ins[0], "all_to_all");
      inLens.push_back(ins[r].nbytes());
      outLens.push_back(outs[r].nbytes());
    }
    auto flatIn = flatten(ins);
    int64_t outElems = 0;
    for (auto& o : outs) {
      outElems += o.numel();
    }
    auto flatOut = at::empty({outElems}, outs[0].options());
    return run(c10d::OpType::ALLTOALL, outs, [&](SluiceWork& w) {
      w.temp(flatIn);
      w.temp(flatOut);
      w.after([flatOut, outs]() mutable {
        int64_t at = 0;
        for (auto& o : outs) {
          o.view({-1}).copy_(flatOut.narrow(0, at, o.numel()));
          at += o.numel();
        }
      });
      w.part([&](sluice_done_fn d, void* u) {
        return sluice_group_all_to_all(group_, flatIn.data_ptr(), flatIn.nbytes(), inLens.data(), flatOut.data_ptr(),
                                       flatOut.nbytes(), outLens.data(), d, u);
      });
    });
  }

  c10::intrusive_ptr<Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    auto& t = one(tensors, "send");
    auto to = checkedRoot(dst);
    return run(c10d::OpType::SEND, tensors, [&](SluiceWork& w) {
      w.part([&](sluice_done_fn d, void* u) {
        return sluice_group_send(group_, to, static_cast<uint32_t>(tag), t.data_ptr(), t.nbytes(), d, u);
      });
    });
  }

  c10::intrusive_ptr<Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    auto& t = one(tensors, "recv");
    auto from = checkedRoot(src);
    return run(c10d::OpType::RECV, tensors, [&](SluiceWork& w) {
      w.part([&](sluice_done_fn d, void* u) {
        return sluice_group_recv(group_, from, static_cast<uint32_t>(tag), t.data_ptr(), t.nbytes(), d, u);
      });
    });
  }

  c10::intrusive_ptr<Work> recvAnysource(std::vector<at::Tensor>&, int) override {
    TORCH_CHECK(false,
                "sluice: recv from any source is not supported (messages match by sender and tag); "
                "name the source rank");
  }

  c10::intrusive_ptr<Work> barrier(const c10d::BarrierOptions&) override {
    std::vector<at::Tensor> none;
    return run(c10d::OpType::BARRIER, none, [&](SluiceWork& w) {
      w.part([&](sluice_done_fn d, void* u) { return sluice_group_barrier(group_, d, u); });
    });
  }

  void monitoredBarrier(const c10d::BarrierOptions& opts, bool) override {
    auto timeout = opts.timeout == c10d::kUnsetTimeout ? timeout_ : opts.timeout;
    // A rank lost on the way fails the barrier naming it; one that never arrives, at the timeout.
    barrier(opts)->wait(timeout);
  }

  void abort() override {
    if (group_) {
      sluice_group_abort(group_, "the process group was aborted");
    }
  }

  void shutdown() override {
    // Leave with the others; an error (a rank already gone) is not the caller's concern here.
    if (group_ && !closed_.exchange(true)) {
      sluice_group_close(group_);
    }
  }

 private:
  static void check(int rc, const std::string& what) {
    TORCH_CHECK(rc == SLUICE_OK, "sluice: ", what, ": ", groupError(rc));
  }

  // Makes the Work, starts its parts through `body`, and hands it back.
  c10::intrusive_ptr<Work> run(c10d::OpType type, const std::vector<at::Tensor>& outputs,
                               const std::function<void(SluiceWork&)>& body) {
    Graveyard::get().empty();
    auto work = c10::make_intrusive<SluiceWork>(getRank(), type, outputs);
    for (auto& t : outputs) {
      work->keep(t);
    }
    try {
      body(*work);
    } catch (...) {
      work->started();
      throw;
    }
    work->started();
    return work;
  }

  c10::intrusive_ptr<Work> allreduceAll(std::vector<at::Tensor>& tensors, const c10d::ReduceOp& rop,
                                        c10d::OpType type) {
    TORCH_CHECK(!tensors.empty(), "sluice: allreduce of no tensors");
    int op = reduceOp(rop, "allreduce");
    for (auto& t : tensors) {
      dense(t, "allreduce tensor");
      floatingForAvg(rop, t, "allreduce");
    }
    std::vector<at::Tensor> none;
    disjoint(tensors, none, "allreduce");
    return run(type, tensors, [&](SluiceWork& w) {
      for (auto& t : tensors) {
        w.part([&](sluice_done_fn d, void* u) {
          return sluice_group_all_reduce(group_, t.data_ptr(), t.nbytes(), dtype(t), op, d, u);
        });
      }
    });
  }

  c10::intrusive_ptr<Work> reduceScatterAll(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
                                            const c10d::ReduceScatterOptions& opts, c10d::OpType type) {
    TORCH_CHECK(outs.size() == ins.size(), "sluice: ", outs.size(), " outputs for ", ins.size(), " inputs");
    int op = reduceOp(opts.reduceOp, "reduce_scatter");
    for (size_t i = 0; i < ins.size(); i++) {
      dense(ins[i], "reduce_scatter_tensor input");
      dense(outs[i], "reduce_scatter_tensor output");
      sameType(outs[i], ins[i], "reduce_scatter_tensor");
      floatingForAvg(opts.reduceOp, outs[i], "reduce_scatter_tensor");
      TORCH_CHECK(ins[i].numel() == outs[i].numel() * getSize(), "sluice: reduce_scatter_tensor input has ",
                  ins[i].numel(), " elements for an output of ", outs[i].numel(), " over ", getSize(), " ranks");
    }
    disjoint(outs, ins, "reduce_scatter_tensor");
    return run(type, outs, [&](SluiceWork& w) {
      for (size_t i = 0; i < ins.size(); i++) {
        w.keep(ins[i]);
        w.part([&](sluice_done_fn d, void* u) {
          return sluice_group_reduce_scatter(group_, ins[i].data_ptr(), ins[i].nbytes(), outs[i].data_ptr(),
                                             outs[i].nbytes(), dtype(outs[i]), op, d, u);
        });
      }
    });
  }

  // The one tensor an operation takes (checked dense).
  static at::Tensor& one(std::vector<at::Tensor>& tensors, const char* what) {
    TORCH_CHECK(tensors.size() == 1, "sluice: ", what, " takes one tensor per rank (got ", tensors.size(), ")");
    dense(tensors[0], what);
    return tensors[0];
  }

  static void dense(const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.defined(), "sluice: ", what, " is an undefined tensor");
    TORCH_CHECK(t.device().is_cpu(), "sluice: ", what, " is on ", t.device(),
                "; the sluice backend carries CPU tensors (use nccl or gloo for CUDA ones)");
    TORCH_CHECK(t.layout() == at::kStrided, "sluice: ", what, " is a ", t.layout(),
                " tensor; the sluice backend carries dense ones");
    TORCH_CHECK(t.is_contiguous(), "sluice: ", what, " is not contiguous (sizes ", t.sizes(), ", strides ",
                t.strides(), "); pass a contiguous tensor (.contiguous())");
    TORCH_CHECK(!t.is_conj() && !t.is_neg(), "sluice: ", what,
                " is a lazily conjugated or negated view; pass .resolve_conj().resolve_neg()");
  }

  // AVG is for floating point and complex tensors (said at the call on every rank, so none
  // waits for the others).
  static void floatingForAvg(const c10d::ReduceOp& op, const at::Tensor& t, const char* what) {
    TORCH_CHECK(op.op_ != c10d::ReduceOp::AVG || t.is_floating_point() || t.is_complex(), "sluice: ", what,
                " with AVG on ", t.scalar_type(), " tensors; use SUM and divide");
  }

  // The parts of one coalesced call may not share memory: each part reads or writes its own
  // tensors while the others run (part i is a[i] and, where given, b[i]; a part's own input and
  // output may overlap, the library copies such an input first).
  static void disjoint(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, const char* what) {
    std::vector<std::tuple<uintptr_t, uintptr_t, size_t>> spans;
    for (const auto* list : {&a, &b}) {
      for (size_t i = 0; i < list->size(); i++) {
        auto& t = (*list)[i];
        if (t.nbytes() > 0) {
          auto p = reinterpret_cast<uintptr_t>(t.data_ptr());
          spans.emplace_back(p, p + t.nbytes(), i);
        }
      }
    }
    std::sort(spans.begin(), spans.end());
    uintptr_t end = 0;
    size_t endPart = 0;
    for (auto& [start, stop, part] : spans) {
      TORCH_CHECK(start >= end || part == endPart, "sluice: tensors of different parts of one ", what,
                  " call overlap in memory; pass separate tensors");
      if (stop > end) {
        end = stop;
        endPart = part;
      }
    }
  }

  static void sameType(const at::Tensor& a, const at::Tensor& b, const char* what) {
    TORCH_CHECK(a.scalar_type() == b.scalar_type(), "sluice: ", what, " mixes dtypes ", a.scalar_type(), " and ",
                b.scalar_type());
  }

  // Each of `list` (n of them) is dense and like `like` in dtype and element count.
  static void sameEach(const std::vector<at::Tensor>& list, const at::Tensor& like, int n, const char* what) {
    TORCH_CHECK(static_cast<int>(list.size()) == n, "sluice: ", what, " takes a list of ", n, " tensors (got ",
                list.size(), ")");
    for (auto& t : list) {
      dense(t, what);
      sameType(t, like, what);
      TORCH_CHECK(t.numel() == like.numel(), "sluice: ", what, " list tensors have ", t.numel(),
                  " elements where ", like.numel(), " were expected");
    }
  }

  static at::Tensor flatten(const std::vector<at::Tensor>& list) {
    std::vector<at::Tensor> flat;
    for (auto& t : list) {
      flat.push_back(t.reshape({-1}));
    }
    return at::cat(flat);
  }

  static void unflatten(const at::Tensor& flat, std::vector<at::Tensor>& outs, int64_t n) {
    for (size_t r = 0; r < outs.size(); r++) {
      outs[r].view({-1}).copy_(flat.narrow(0, static_cast<int64_t>(r) * n, n));
    }
  }

  // Split sizes (rows of dim 0) as byte lengths; none: even pieces.
  std::vector<size_t> splitBytes(const at::Tensor& t, const std::vector<int64_t>& splits, const char* what) const {
    std::vector<size_t> lens;
    int64_t rows = t.dim() == 0 ? 1 : t.size(0);
    if (splits.empty()) {
      TORCH_CHECK(rows % getSize() == 0, "sluice: all_to_all_single ", what, " of ", rows, " rows does not split evenly over ",
                  getSize(), " ranks");
      lens.assign(getSize(), t.nbytes() / getSize());
      return lens;
    }
    TORCH_CHECK(static_cast<int>(splits.size()) == getSize(), "sluice: all_to_all_single ", what, " has ",
                splits.size(), " split sizes for ", getSize(), " ranks");
    size_t row = rows == 0 ? 0 : t.nbytes() / rows;
    int64_t sum = 0;
    for (auto s : splits) {
      TORCH_CHECK(s >= 0, "sluice: all_to_all_single ", what, " split size ", s);
      sum += s;
      lens.push_back(static_cast<size_t>(s) * row);
    }
    TORCH_CHECK(sum == rows, "sluice: all_to_all_single ", what, " split sizes sum to ", sum, " of ", rows, " rows");
    return lens;
  }

  uint32_t checkedRoot(int64_t r) const {
    TORCH_CHECK(r >= 0 && r < getSize(), "sluice: rank ", r, " in a group of ", getSize());
    return static_cast<uint32_t>(r);
  }

  static DLDataType dtype(const at::Tensor& t) { return at::getDLDataType(t); }

  static int reduceOp(const c10d::ReduceOp& op, const char* what) {
    switch (op.op_) {
      case c10d::ReduceOp::SUM:
        return SLUICE_REDUCE_SUM;
      case c10d::ReduceOp::AVG:
        return SLUICE_REDUCE_AVG;
      case c10d::ReduceOp::PRODUCT:
        return SLUICE_REDUCE_PRODUCT;
      case c10d::ReduceOp::MIN:
        return SLUICE_REDUCE_MIN;
      case c10d::ReduceOp::MAX:
        return SLUICE_REDUCE_MAX;
      default:
        TORCH_CHECK(false, "sluice: ", what, " with reduce op ", static_cast<int>(op.op_),
                    " is not supported (SUM, AVG, PRODUCT, MIN and MAX are)");
    }
  }

  std::chrono::milliseconds timeout_;
  sluice_context* ctx_ = nullptr;
  sluice_group* group_ = nullptr;
  std::atomic<bool> closed_{false};
};

void bindProcessGroup(py::module& m) {
  m.def(
      "new_process_group",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout,
         const std::string& name, const std::string& host) -> c10::intrusive_ptr<c10d::Backend> {
        return c10::make_intrusive<SluiceBackend>(store, rank, size, timeout, name, host);
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("name"), py::arg("host"),
      py::call_guard<py::gil_scoped_release>(),
      "Forms a Sluice collective group through `store` and returns it as a c10d Backend.");
}

}  // namespace sluice_torch
