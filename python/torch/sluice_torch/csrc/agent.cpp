// Sluice under PyTorch: a `torch::distributed::rpc::RpcAgent` whose messages travel over Sluice
// pipes (libsluice_c), registered with torch.distributed.rpc as backend "SLUICE".
//
// Shape (after TensorPipe's agent, which this replaces):
// - One pipe per ordered pair of workers: worker A's requests to B go on the pipe A opened to
//   B's listener, and B answers on the same pipe. So a client pipe carries requests out and
//   responses in, an accepted (server) pipe requests in and responses out, and a failed pipe
//   fails exactly the calls that used it.
// - Every Sluice message is one RPC message: metadata = a fixed header (magic, version, the
//   message type, the sender's worker id, the message id), one payload (Message::payload), a
//   second payload of one flag byte per tensor, and the Message's tensors (borrowed by the
//   write; a view goes as it lies).
// - CUDA tensors (device maps, as TensorPipe's agent): a request's tensors go to the devices
//   the caller's map for the callee names, a response's back through the reverse of the
//   caller's map (maps are exchanged through the store at start). The sender's current stream
//   orders the read of each tensor; the receiver allocates with PyTorch's allocator on a
//   stream from the pool per device (sluice_pipe_read_then_with), runs the request callback
//   with those streams current, and completes a caller's future with them current, so later
//   work waits for the copies without a synchronize. Messages without CUDA tensors never
//   touch CUDA (a CPU-only torch works).
// - Threads: one accept thread, a timeout thread, and a pool (num_worker_threads) that runs
//   request callbacks and completes every future. Pipes are read by chains of read callbacks
//   (sluice_pipe_read_then) on Sluice's own threads, which only decode and hand over: user
//   callbacks never run there.
// - Every pending call completes exactly once: whoever removes it from `pending` (the reply,
//   the timeout, a failed write, a lost pipe, shutdown) completes it.
// - Bytes from a peer are parsed, never trusted: a header of the wrong size, magic or version,
//   a message that is not a request on a server pipe (or not a response on a client pipe), or
//   a tensor whose description does not match its bytes closes that pipe and fails its calls
//   with an error naming the worker.

#include <ATen/DLConvertor.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/core/thread_pool.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/rpc/agent_utils.h>
#include <torch/csrc/distributed/rpc/request_callback_impl.h>
#include <torch/csrc/distributed/rpc/rpc_agent.h>
#include <torch/csrc/distributed/rpc/utils.h>
#include <torch/csrc/utils/pybind.h>

#include "sluice.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <variant>
#include <vector>

namespace sluice_torch {

using namespace torch::distributed::rpc;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x52544c53;  // "SLTR"
// 2: the flag byte's bits 1-7 (an empty tensor for a GPU). 3: a third payload, the views of
// storages sent once (tensors that share one storage arrive sharing one).
constexpr uint32_t kVersion = 3;

// A tensor's flag byte: bit 0 requires_grad; bit 1 an empty tensor (sent as an empty CPU one)
// for the receiver's GPU whose index is in bits 2-7.
constexpr uint8_t kRequiresGrad = 1;
constexpr uint8_t kEmptyOnGpu = 2;

// A message's tensors that share one storage go as one Sluice tensor (the bytes their views
// span, as `uint8`), sent after the tensors that go alone, and each of them as a view record in
// a third payload: which of the message's tensors it is, which Sluice tensor holds its bytes,
// where in them it starts, its dtype, shape and strides.
struct ViewRecord {
  uint32_t tensor;
  uint32_t source;
  uint64_t offset;
  DLDataType dtype;
  uint32_t ndim;
  // then int64 shape[ndim], int64 strides[ndim]
};
static_assert(sizeof(ViewRecord) == 24, "view record layout");
// No tensor has more dimensions than this (PyTorch's own limit is lower).
constexpr uint32_t kMaxDims = 64;

using Streams = std::vector<c10::Stream>;

// What a worker that failed to start publishes in the store instead of its maps or address.
constexpr const char* kFailed = "! failed: ";

struct Header {
  uint32_t magic;
  uint32_t version;
  int32_t type;
  int32_t from;
  int64_t id;
};
static_assert(sizeof(Header) == 24, "header layout");

// A pipe that failed because the connection did (the peer's process died, it closed the pipe,
// the connection reset), not because this side closed it or the peer sent something bad.
bool connectionLost(int status) {
  return status == SLUICE_PEER_LOST || status == SLUICE_IO;
}

std::string lastError(int status) {
  const char* e = sluice_last_error();
  std::string s = (e && *e) ? e : "";
  return std::string(sluice_status_name(status)) + (s.empty() ? "" : ": " + s);
}

// A pipe shared by its reader and by the writes still answering on it; freed with the last.
struct Pipe {
  sluice_pipe* raw;
  explicit Pipe(sluice_pipe* p) : raw(p) {}
  ~Pipe() { sluice_pipe_free(raw); }
  void close() { sluice_pipe_close(raw); }
};

struct Pending {
  c10::intrusive_ptr<JitFuture> future;
  worker_id_t to;
  const Pipe* via;  // the pipe the request went on: its failure fails this call
  Clock::time_point started;
  std::optional<Clock::time_point> deadline;
};

struct Stats {
  std::atomic<uint64_t> sent{0}, received{0}, bytesSent{0}, bytesReceived{0};
  // Requests served: how many, and the nanoseconds from arrival to the start of the request
  // callback (the pool's queue) and from arrival to the response's write (all of it).
  std::atomic<uint64_t> served{0}, queuedNs{0}, servedNs{0};
};

// What outlives the agent object: everything a library callback or a future's callback may
// touch after the agent started shutting down.
struct Core : std::enable_shared_from_this<Core> {
  // The group's members, and the agent's maps by member (its names, pipes, channels). A static
  // group fills them before it starts and never changes them; a dynamic one changes them as
  // workers join and leave (under `membersMu`, held exclusively for that and shared to read).
  // A member that leaves is kept in `retired`, so a WorkerInfo handed out stays valid.
  mutable std::shared_mutex membersMu;
  std::unordered_map<worker_id_t, std::shared_ptr<const WorkerInfo>> workers;
  std::vector<std::shared_ptr<const WorkerInfo>> retired;

  // A dynamic group's agent drops a member whose pipe failed (it died, or went away without
  // leaving). Set by the agent, cleared by its shutdown (under lostMu: never called after).
  std::mutex lostMu;
  std::function<void(worker_id_t, const void*)> onLost;

  // Never throws: it runs on the library's threads.
  void lost(worker_id_t id, const void* pipe) noexcept {
    std::lock_guard<std::mutex> l(lostMu);
    if (onLost) {
      try {
        onLost(id, pipe);
      } catch (const std::exception& e) {
        TORCH_WARN("sluice: dropping worker id ", id, " from the group failed: ", e.what());
      }
    }
  }
  std::unique_ptr<c10::ThreadPool> pool;
  std::mutex postMu;
  bool stopped = false;  // under postMu: nothing is posted to the pool any more

  std::mutex mu;  // pending, timeouts, counters below
  std::condition_variable idle;
  std::unordered_map<int64_t, Pending> pending;
  std::multimap<Clock::time_point, int64_t> deadlines;
  std::condition_variable timerCv;
  bool timerStop = false;
  int64_t clientActive = 0;
  int64_t serverActive = 0;
  std::unordered_map<worker_id_t, std::pair<uint64_t, double>> latency;  // calls, total seconds
  Stats stats;

  std::string name(worker_id_t id) const {
    std::shared_lock<std::shared_mutex> l(membersMu);
    return nameLocked(id);
  }

  // `name` for a caller that holds membersMu already.
  std::string nameLocked(worker_id_t id) const {
    auto it = workers.find(id);
    return it == workers.end() ? "worker id " + std::to_string(id) : it->second->name_;
  }

  // Runs `f` on the pool unless the agent has stopped (then it is dropped).
  bool post(std::function<void()> f) {
    std::lock_guard<std::mutex> l(postMu);
    if (stopped) {
      return false;
    }
    pool->run(std::move(f));
    return true;
  }

  // Removes call `id` if it is still pending (exactly one caller gets it), and its deadline.
  std::optional<Pending> take(int64_t id) {
    std::lock_guard<std::mutex> l(mu);
    auto it = pending.find(id);
    if (it == pending.end()) {
      return std::nullopt;
    }
    return takeLocked(it);
  }

  Pending takeLocked(std::unordered_map<int64_t, Pending>::iterator it) {
    Pending p = std::move(it->second);
    if (p.deadline) {
      auto [from, to] = deadlines.equal_range(*p.deadline);
      for (auto d = from; d != to; ++d) {
        if (d->second == it->first) {
          deadlines.erase(d);
          break;
        }
      }
    }
    pending.erase(it);
    return p;
  }

  void finished() {
    std::lock_guard<std::mutex> l(mu);
    if (--clientActive == 0) {
      idle.notify_all();  // join waits on it (a dynamic member's also for serverActive)
    }
  }

  // Completes a taken call with an error, on the pool (or here if the pool has stopped).
  void fail(Pending p, std::string error) {
    auto run = [self = shared_from_this(), p, error]() mutable {
      p.future->setErrorIfNeeded(std::make_exception_ptr(std::runtime_error(error)));
      self->finished();
    };
    if (!post(run)) {
      run();
    }
  }

  void failWhere(const std::function<bool(const Pending&)>& which, const std::string& error) {
    std::vector<Pending> out;
    {
      std::lock_guard<std::mutex> l(mu);
      std::vector<int64_t> ids;
      for (const auto& [id, p] : pending) {
        if (which(p)) {
          ids.push_back(id);
        }
      }
      for (int64_t id : ids) {
        out.push_back(takeLocked(pending.find(id)));
      }
    }
    for (auto& p : out) {
      fail(std::move(p), error);
    }
  }

  // `streams`: where the response's CUDA tensors were copied (empty for CPU-only ones); the
  // future completes with them current, so whoever waits on it waits for those copies.
  void complete(int64_t id, c10::intrusive_ptr<Message> response, Streams streams) {
    auto p = take(id);
    if (!p) {
      return;  // timed out or failed already: a late reply is dropped
    }
    {
      std::lock_guard<std::mutex> l(mu);
      auto& [n, secs] = latency[p->to];
      n += 1;
      secs += std::chrono::duration<double>(Clock::now() - p->started).count();
    }
    auto run = [self = shared_from_this(), p = std::move(*p), response, streams = std::move(streams)]() mutable {
      std::optional<c10::MultiStreamGuard> guard;
      if (!streams.empty()) {
        guard.emplace(streams);
      }
      if (response->type() == MessageType::EXCEPTION) {
        auto& b = response->payload();
        p.future->setErrorIfNeeded(std::make_exception_ptr(std::runtime_error(std::string(b.begin(), b.end()))));
      } else {
        auto storages = response->getStorages();
        p.future->markCompleted(c10::IValue(response), std::move(storages));
      }
      self->finished();
    };
    if (!post(run)) {
      run();
    }
  }
};

// Borrowed tensors stay alive until the library releases them.
void releaseTensor(void* user) {
  delete static_cast<at::Tensor*>(user);
}

// Where a tensor on `device` goes at `to` under `map`: CPU tensors stay on the CPU; a CUDA one
// must be mapped (TensorPipe's rule and, for the suites, its words).
c10::Device targetOf(const c10::Device& device, const DeviceMap& map, const std::string& to) {
  auto it = map.find(device);
  if (it != map.end()) {
    return it->second;
  }
  TORCH_CHECK(device.is_cpu(),
              "TensorPipe RPC backend only supports CPU tensors by default, please move your tensors to CPU before "
              "sending them over RPC, or call `set_device_map` on `TensorPipeRpcBackendOptions` to explicitly "
              "configure device mapping. (SLUICE backend: ",
              device, " has no mapping for destination ", to, ")");
  return c10::Device(c10::kCPU);
}

// The elements a strided tensor's view spans in its storage, from its first (0 for an empty one).
int64_t spanOf(const at::Tensor& t) {
  if (t.numel() == 0) {
    return 0;
  }
  int64_t span = 1;
  for (int64_t d = 0; d < t.dim(); ++d) {
    span += (t.size(d) - 1) * t.stride(d);
  }
  return span;
}

// Whether `t` arrives sharing its storage with the message's other tensors on that storage, by
// TensorPipe's rule (its `cloneSparseTensors`): a view that uses less than half of a storage of
// 8 KiB or more is sent alone; the others go with their storage. CPU tensors only: a CUDA
// tensor is always sent alone, as is a conjugate or negative view (sent resolved) and one whose
// storage does not hold its span (freed with `resize_(0)`: refused where it is sent alone).
bool sentWithItsStorage(const at::Tensor& t) {
  if (!t.device().is_cpu() || t.layout() != at::kStrided || t.is_nested() || t.numel() == 0 || !t.has_storage() ||
      t.is_conj() || t.is_neg() || t.storage().data() == nullptr) {
    return false;
  }
  size_t storage = t.storage().nbytes();
  if (static_cast<size_t>((t.storage_offset() + spanOf(t)) * static_cast<int64_t>(t.element_size())) > storage) {
    return false;
  }
  return storage < 8192 || storage < 2 * t.nbytes();
}

// The tensors of `tensors` that share a storage with another, by storage: each group's indices
// in order, groups in the order of their first tensor. Tensors sent alone are in none.
std::vector<std::vector<size_t>> sharedStorages(const std::vector<at::Tensor>& tensors) {
  std::vector<std::vector<size_t>> groups;
  if (tensors.size() < 2) {
    return groups;
  }
  std::vector<std::pair<const c10::StorageImpl*, size_t>> keyed;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (sentWithItsStorage(tensors[i])) {
      keyed.emplace_back(tensors[i].storage().unsafeGetStorageImpl(), i);
    }
  }
  std::sort(keyed.begin(), keyed.end());
  for (size_t a = 0; a < keyed.size();) {
    size_t b = a + 1;
    while (b < keyed.size() && keyed[b].first == keyed[a].first) {
      ++b;
    }
    if (b - a >= 2) {
      std::vector<size_t> members;
      for (size_t k = a; k < b; ++k) {
        members.push_back(keyed[k].second);
      }
      groups.push_back(std::move(members));
    }
    a = b;
  }
  std::sort(groups.begin(), groups.end(), [](const auto& x, const auto& y) { return x[0] < y[0]; });
  return groups;
}

template <typename T>
void appendRaw(std::vector<uint8_t>& out, const T* values, size_t count) {
  const auto* bytes = reinterpret_cast<const uint8_t*>(values);
  out.insert(out.end(), bytes, bytes + count * sizeof(T));
}

// A Sluice message for `m` from worker `from` to worker `to`, its CUDA tensors sent where `map`
// says. Throws on a tensor Sluice cannot carry.
sluice_message* encode(const Message& m, int32_t from, Stats& stats, const DeviceMap& map, const std::string& to) {
  sluice_message* out = nullptr;
  TORCH_CHECK(sluice_message_new(&out) == SLUICE_OK, "sluice: ", lastError(SLUICE_PANIC));
  std::unique_ptr<sluice_message, void (*)(sluice_message*)> guard(out, sluice_message_free);
  Header h{kMagic, kVersion, static_cast<int32_t>(m.type()), from, m.id()};
  sluice_message_set_metadata(out, reinterpret_cast<const uint8_t*>(&h), sizeof(h));
  const auto& payload = m.payload();
  int s = sluice_message_add_payload(out, reinterpret_cast<const uint8_t*>(payload.data()), payload.size());
  TORCH_CHECK(s == SLUICE_OK, "sluice: payload: ", lastError(s));
  uint64_t bytes = payload.size();
  static uint8_t empty = 0;
  // One flag byte per tensor (bit 0: requires_grad), as a second payload: distributed autograd
  // needs to know, as TensorPipe's pickled tensor table tells it.
  std::vector<uint8_t> flags;
  const auto& tensors = m.tensors();
  auto groups = sharedStorages(tensors);
  std::vector<bool> grouped(tensors.size(), false);
  for (const auto& g : groups) {
    for (size_t i : g) {
      grouped[i] = true;
    }
  }
  for (size_t index = 0; index < tensors.size(); ++index) {
    const at::Tensor& t = tensors[index];
    if (grouped[index]) {
      // A CPU tensor (sentWithItsStorage), sent with its storage below.
      TORCH_CHECK(targetOf(t.device(), map, to).is_cpu(), "the SLUICE RPC backend sends CPU tensors to the CPU only (",
                  t.device(), " is mapped to ", targetOf(t.device(), map, to), " for ", to, ")");
      flags.push_back(t.requires_grad() ? kRequiresGrad : 0);
      continue;
    }
    TORCH_CHECK(t.layout() == at::kStrided, "the SLUICE RPC backend carries strided tensors only; got ", t.layout());
    TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), "the SLUICE RPC backend carries CPU and CUDA tensors; got one on ",
                t.device());
    c10::Device target = targetOf(t.device(), map, to);
    TORCH_CHECK(t.device().is_cuda() || target.is_cpu(), "the SLUICE RPC backend sends CPU tensors to the CPU only (",
                t.device(), " is mapped to ", target, " for ", to, ")");
    uint8_t flag = t.requires_grad() ? kRequiresGrad : 0;
    bool gpu = t.device().is_cuda();
    if (gpu && t.numel() == 0) {
      // Nothing to move: an empty CPU tensor, made on the GPU on arrival.
      gpu = false;
      if (target.is_cuda()) {
        TORCH_CHECK(target.index() < 64, "the SLUICE RPC backend maps to GPUs 0-63; got ", target);
        flag |= kEmptyOnGpu | static_cast<uint8_t>(target.index() << 2);
      }
    }
    flags.push_back(flag);
    // A view goes as it lies (its span, with its strides), so it arrives with the same layout;
    // one whose span is far larger than its elements goes as a compact copy instead.
    bool compact = t.numel() > 0 && spanOf(t) * static_cast<int64_t>(t.element_size()) >
                                        static_cast<int64_t>(4 * t.nbytes() + (64 << 10));
    // A conjugate or negative view goes as its values (the bit does not travel).
    at::Tensor source = t.is_conj() || t.is_neg() ? t.detach().resolve_conj().resolve_neg() : t.detach();
    if (t.device().is_cuda() && !gpu) {
      source = at::empty(t.sizes(), t.options().device(c10::kCPU));
    }
    auto* held = new at::Tensor(compact ? source.contiguous() : source);
    DLTensor dl{};
    dl.data = held->numel() == 0 ? static_cast<void*>(&empty) : held->data_ptr();
    dl.device = gpu ? DLDevice{kDLCUDA, static_cast<int32_t>(t.device().index())} : DLDevice{kDLCPU, 0};
    dl.ndim = static_cast<int32_t>(held->dim());
    try {
      dl.dtype = at::getDLDataType(*held);
    } catch (...) {
      delete held;
      throw;
    }
    dl.shape = const_cast<int64_t*>(held->sizes().data());
    dl.strides = held->numel() == 0 ? nullptr : const_cast<int64_t*>(held->strides().data());
    dl.byte_offset = 0;
    bytes += held->nbytes();
    if (gpu) {
      // Read after the work queued so far on the tensor's current stream (the caller's, or the
      // pool stream a response was computed on).
      c10::impl::VirtualGuardImpl impl(c10::kCUDA);
      c10::Stream current = impl.getStream(t.device());
      // The write completes in this stream's order: PyTorch's allocator must not hand the block
      // to another stream before the work queued here (our read) is done.
      impl.recordDataPtrOnStream(held->storage().data_ptr(), current);
      auto stream = reinterpret_cast<size_t>(current.native_handle());
      s = sluice_message_add_cuda_tensor(out, &dl, stream, target.is_cuda() ? target.index() : -1, releaseTensor, held);
    } else {
      s = sluice_message_add_tensor(out, &dl, releaseTensor, held);
    }
    if (s != SLUICE_OK) {
      delete held;
      TORCH_CHECK(false, "sluice: tensor of ", t.scalar_type(), ": ", lastError(s));
    }
  }
  s = sluice_message_add_payload(out, flags.data(), flags.size());
  TORCH_CHECK(s == SLUICE_OK, "sluice: payload: ", lastError(s));
  if (!groups.empty()) {
    // Each shared storage once: the bytes from its first view's first byte to its last view's
    // last, then a view record per tensor on it.
    // Records in the order of their tensors (the receiver checks it), groups interleaved or not.
    std::vector<std::pair<size_t, std::vector<uint8_t>>> records;
    uint32_t source = static_cast<uint32_t>(tensors.size());
    for (const auto& g : groups) {
      source -= static_cast<uint32_t>(g.size());
    }
    for (const auto& g : groups) {
      // From a multiple of 16 bytes (the largest element) at or before the first view's first
      // byte, so every view starts at a multiple of its own element size (views of several
      // dtypes), to the last view's last byte.
      int64_t lo = std::numeric_limits<int64_t>::max();
      int64_t hi = 0;
      for (size_t i : g) {
        const at::Tensor& t = tensors[i];
        int64_t item = static_cast<int64_t>(t.element_size());
        lo = std::min(lo, t.storage_offset() * item);
        hi = std::max(hi, (t.storage_offset() + spanOf(t)) * item);
      }
      lo -= lo % 16;
      for (size_t i : g) {
        const at::Tensor& t = tensors[i];
        ViewRecord rec{static_cast<uint32_t>(i), source,
                       static_cast<uint64_t>(t.storage_offset() * static_cast<int64_t>(t.element_size()) - lo),
                       at::getDLDataType(t), static_cast<uint32_t>(t.dim())};
        std::vector<uint8_t> bytesOf;
        appendRaw(bytesOf, &rec, 1);
        appendRaw(bytesOf, t.sizes().data(), t.dim());
        appendRaw(bytesOf, t.strides().data(), t.dim());
        records.emplace_back(i, std::move(bytesOf));
      }
      // A byte view of the storage, which it keeps alive (sentWithItsStorage checked that the
      // storage holds every view's span, so `set_` never grows it).
      auto* held = new at::Tensor(at::empty({0}, at::TensorOptions().dtype(at::kByte))
                                      .set_(tensors[g[0]].storage(), lo, {hi - lo}, {1}));
      DLTensor dl{};
      dl.data = held->data_ptr();
      dl.device = DLDevice{kDLCPU, 0};
      dl.ndim = 1;
      dl.dtype = DLDataType{kDLUInt, 8, 1};
      dl.shape = const_cast<int64_t*>(held->sizes().data());
      dl.strides = const_cast<int64_t*>(held->strides().data());
      bytes += held->nbytes();
      s = sluice_message_add_tensor(out, &dl, releaseTensor, held);
      if (s != SLUICE_OK) {
        delete held;
        TORCH_CHECK(false, "sluice: a shared storage of ", hi - lo, " bytes: ", lastError(s));
      }
      ++source;
    }
    std::sort(records.begin(), records.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
    std::vector<uint8_t> views;
    for (const auto& r : records) {
      views.insert(views.end(), r.second.begin(), r.second.end());
    }
    s = sluice_message_add_payload(out, views.data(), views.size());
    TORCH_CHECK(s == SLUICE_OK, "sluice: payload: ", lastError(s));
  }
  stats.sent += 1;
  stats.bytesSent += bytes;
  return guard.release();
}

// The RPC message a Sluice message carries, or an error saying why it is malformed.
// `devices`: the GPUs this worker receives on.
std::variant<c10::intrusive_ptr<Message>, std::string> decodeUnchecked(sluice_received* r, Header& h, Stats& stats,
                                                                       const std::vector<c10::Device>& devices);

// Never throws: whatever goes wrong making the tensors is the message's fault, as text.
std::variant<c10::intrusive_ptr<Message>, std::string> decode(sluice_received* r, Header& h, Stats& stats,
                                                              const std::vector<c10::Device>& devices) {
  try {
    return decodeUnchecked(r, h, stats, devices);
  } catch (const std::exception& e) {
    return std::string("a message whose tensors cannot be rebuilt: ") + e.what();
  }
}

// Sluice tensor `j`'s bytes (in CPU memory) as a byte tensor of this process's own, writable
// memory, starting at a multiple of `align`: taken without a copy where a channel filled memory
// of ours, copied where the pipe lends its memory (a shared segment, read-only) or the bytes
// start misaligned (a small tensor inside a frame).
at::Tensor ownBytes(sluice_received* r, size_t j, size_t align) {
  auto options = at::TensorOptions().dtype(at::kByte);
  sluice_buffer* owned = nullptr;
  uint8_t* taken = nullptr;
  size_t len = 0;
  const uint8_t* from = nullptr;
  if (sluice_received_tensor_take(r, j, &owned, &taken, &len) == SLUICE_OK && owned != nullptr) {
    if (reinterpret_cast<uintptr_t>(taken) % align == 0) {
      return at::from_blob(taken, {static_cast<int64_t>(len)}, [owned](void*) { sluice_buffer_free(owned); }, options);
    }
    from = taken;
  } else {
    sluice_received_tensor_data(r, j, &from, &len);
  }
  at::Tensor copy = at::empty({static_cast<int64_t>(len)}, options);
  if (len > 0) {
    std::memcpy(copy.data_ptr(), from, len);
  }
  if (owned != nullptr) {
    sluice_buffer_free(owned);
  }
  return copy;
}

// Message tensor `i`, sent alone as Sluice tensor `j` with flag byte `flag`, or why it cannot
// be rebuilt. `devices`: the GPUs this worker receives on.
std::variant<at::Tensor, std::string> plainTensor(sluice_received* r, size_t j, size_t i, uint8_t flag,
                                                  const std::vector<c10::Device>& devices) {
  DLTensor dl{};
  int s = sluice_received_tensor(r, j, &dl);
  if (s != SLUICE_OK) {
    return "tensor " + std::to_string(i) + ": " + lastError(s);
  }
  at::ScalarType type;
  try {
    type = at::toScalarType(dl.dtype);
  } catch (const c10::Error& e) {
    return "tensor " + std::to_string(i) + ": " + e.what_without_backtrace();
  }
  std::vector<int64_t> shape(dl.shape, dl.shape + dl.ndim);
  std::vector<int64_t> strides(dl.strides, dl.strides + dl.ndim);
  // The library checked the description against the bytes. The tensor is laid out exactly as
  // the sender's view (the same strides, stride 0 included) over its span, which must be the
  // receiver's own, writable memory (handlers may write into their arguments): memory a
  // channel filled in this process is taken as the tensor's storage without a copy; memory
  // the pipe lends (a shared segment, read-only) is copied.
  auto options = at::TensorOptions().dtype(type);
  int64_t item = static_cast<int64_t>(c10::elementSize(type));
  at::Tensor t;
  size_t stream = 0;
  void* handle = nullptr;
  if (dl.device.device_type == kDLCUDA) {
    // Received into a byte tensor our allocator made (ReadLoop::alloc): viewed as the sender's
    // tensor, no copy.
    sluice_received_tensor_device(r, j, &stream, &handle);
    if (handle == nullptr) {
      return "tensor " + std::to_string(i) + ": in GPU memory no allocator of ours gave";
    }
    const at::Tensor& bytesOnGpu = *static_cast<at::Tensor*>(handle);
    if (bytesOnGpu.numel() % item != 0) {
      return "tensor " + std::to_string(i) + ": " + std::to_string(bytesOnGpu.numel()) + " bytes for elements of " +
          std::to_string(item);
    }
    t = bytesOnGpu.view(type).as_strided(shape, strides);
  } else if (flag & kEmptyOnGpu) {
    if (std::none_of(shape.begin(), shape.end(), [](int64_t d) { return d == 0; })) {
      return "tensor " + std::to_string(i) + ": flagged empty but not empty";
    }
    c10::Device dev(c10::kCUDA, static_cast<c10::DeviceIndex>(flag >> 2));
    if (std::find(devices.begin(), devices.end(), dev) == devices.end()) {
      return "tensor " + std::to_string(i) + ": an empty tensor for " + dev.str() + ", not among this worker's devices";
    }
    t = at::empty(shape, options.device(dev));
  } else {
    t = ownBytes(r, j, static_cast<size_t>(item)).view(type).as_strided(shape, strides);
  }
  return t;
}

// A view record, parsed and checked: message tensor `tensor` is `bytes` bytes of Sluice tensor
// `source` from byte `offset` on, laid out by `shape` and `strides`.
struct StorageView {
  size_t tensor = 0;
  size_t source = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  at::ScalarType type = at::kByte;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
};

// The view records in `data`, or why they are malformed. `nTensors`: the message's tensors
// (its flags); `nSluice`: the Sluice tensors it came in. Each source is referenced, so none is
// sent for nothing.
std::variant<std::vector<StorageView>, std::string> parseViews(const uint8_t* data, size_t len, size_t nTensors,
                                                        size_t nSluice) {
  std::vector<StorageView> views;
  size_t pos = 0;
  while (pos < len) {
    ViewRecord rec{};
    if (len - pos < sizeof(rec)) {
      return std::string("a view record cut short");
    }
    std::memcpy(&rec, data + pos, sizeof(rec));
    pos += sizeof(rec);
    if (rec.ndim > kMaxDims) {
      return "a view of " + std::to_string(rec.ndim) + " dimensions";
    }
    size_t dims = 2 * static_cast<size_t>(rec.ndim) * sizeof(int64_t);
    if (len - pos < dims) {
      return std::string("a view record cut short");
    }
    StorageView v;
    v.tensor = rec.tensor;
    v.source = rec.source;
    v.offset = rec.offset;
    v.shape.resize(rec.ndim);
    v.strides.resize(rec.ndim);
    if (rec.ndim > 0) {
      std::memcpy(v.shape.data(), data + pos, dims / 2);
      std::memcpy(v.strides.data(), data + pos + dims / 2, dims / 2);
    }
    pos += dims;
    std::string what = "the view of tensor " + std::to_string(v.tensor);
    if (v.tensor >= nTensors) {
      return what + " of a message of " + std::to_string(nTensors);
    }
    if (!views.empty() && v.tensor <= views.back().tensor) {
      return what + ": view records out of order";
    }
    try {
      v.type = at::toScalarType(rec.dtype);
    } catch (const c10::Error& e) {
      return what + ": " + e.what_without_backtrace();
    }
    uint64_t item = c10::elementSize(v.type);
    if (v.offset % item != 0) {
      return what + ": offset " + std::to_string(v.offset) + " is not a multiple of its element size";
    }
    // The elements it spans (1 + sum of (size - 1) * stride) and holds, without overflow.
    uint64_t span = 1;
    int64_t numel = 1;
    for (uint32_t d = 0; d < rec.ndim; ++d) {
      if (v.shape[d] < 1 || v.strides[d] < 0) {
        return what + ": size " + std::to_string(v.shape[d]) + " with stride " + std::to_string(v.strides[d]) +
            " in dimension " + std::to_string(d);
      }
      uint64_t step = 0;
      if (__builtin_mul_overflow(static_cast<uint64_t>(v.shape[d] - 1), static_cast<uint64_t>(v.strides[d]), &step) ||
          __builtin_add_overflow(span, step, &span) || __builtin_mul_overflow(numel, v.shape[d], &numel)) {
        return what + ": a shape and strides past any memory";
      }
    }
    uint64_t end = 0;
    int64_t numelBytes = 0;
    if (__builtin_mul_overflow(span, item, &v.bytes) || __builtin_add_overflow(v.bytes, v.offset, &end) ||
        __builtin_mul_overflow(numel, static_cast<int64_t>(item), &numelBytes)) {
      return what + ": a shape and strides past any memory";
    }
    views.push_back(std::move(v));
  }
  if (views.empty()) {
    return std::string("an empty payload of views");
  }
  size_t plain = nTensors - views.size();
  if (nSluice <= plain) {
    return "views of shared storages, but only " + std::to_string(nSluice) + " tensors for the " +
        std::to_string(plain) + " sent alone";
  }
  std::vector<bool> used(nSluice - plain, false);
  for (const auto& v : views) {
    if (v.source < plain || v.source >= nSluice) {
      return "the view of tensor " + std::to_string(v.tensor) + " in tensor " + std::to_string(v.source) +
          " (the shared storages are " + std::to_string(plain) + " to " + std::to_string(nSluice - 1) + ")";
    }
    used[v.source - plain] = true;
  }
  if (std::find(used.begin(), used.end(), false) != used.end()) {
    return std::string("a shared storage no view refers to");
  }
  return views;
}

std::variant<c10::intrusive_ptr<Message>, std::string> decodeUnchecked(sluice_received* r, Header& h, Stats& stats,
                                                                       const std::vector<c10::Device>& devices) {
  const uint8_t* data = nullptr;
  size_t len = 0;
  if (sluice_received_metadata(r, &data, &len) != SLUICE_OK || len != sizeof(Header)) {
    return std::string("a message header of ") + std::to_string(len) + " bytes (expected 24)";
  }
  std::memcpy(&h, data, sizeof(h));
  if (h.magic != kMagic) {
    return std::string("a message that is not a Sluice RPC message (bad magic)");
  }
  if (h.version != kVersion) {
    return "a message of wire version " + std::to_string(h.version) + " (this build speaks " +
        std::to_string(kVersion) + ")";
  }
  size_t nSluice = sluice_received_tensor_count(r);
  size_t payloads = sluice_received_payload_count(r);
  if (payloads != 2 && payloads != 3) {
    return std::string("a message with ") + std::to_string(payloads) + " payloads (expected 2, or 3 with views)";
  }
  const uint8_t* flags = nullptr;
  size_t n = 0;
  sluice_received_payload(r, 1, &flags, &n);
  std::vector<StorageView> views;
  if (payloads == 3) {
    sluice_received_payload(r, 2, &data, &len);
    auto parsed = parseViews(data, len, n, nSluice);
    if (auto* e = std::get_if<std::string>(&parsed)) {
      return std::move(*e);
    }
    views = std::move(std::get<std::vector<StorageView>>(parsed));
  } else if (nSluice != n) {
    return "a message with " + std::to_string(nSluice) + " tensors and " + std::to_string(n) + " tensor flags";
  }
  sluice_received_payload(r, 0, &data, &len);
  std::vector<char> payload(reinterpret_cast<const char*>(data), reinterpret_cast<const char*>(data) + len);
  uint64_t bytes = len;
  std::vector<at::Tensor> tensors;
  tensors.reserve(n);
  // The shared storages, as byte tensors of this process's own memory, made at their first view.
  size_t plain = n - views.size();
  std::vector<at::Tensor> storages(nSluice - plain);
  size_t nextView = 0;
  size_t nextPlain = 0;
  for (size_t i = 0; i < n; ++i) {
    at::Tensor t;
    at::ScalarType type;
    if (nextView < views.size() && views[nextView].tensor == i) {
      const StorageView& v = views[nextView++];
      if (flags[i] & ~kRequiresGrad) {
        return "tensor " + std::to_string(i) + ": a view with flags " + std::to_string(flags[i]);
      }
      at::Tensor& storage = storages[v.source - plain];
      if (!storage.defined()) {
        DLTensor dl{};
        int s = sluice_received_tensor(r, v.source, &dl);
        if (s != SLUICE_OK) {
          return "tensor " + std::to_string(v.source) + ": " + lastError(s);
        }
        if (dl.device.device_type != kDLCPU || dl.ndim != 1 || dl.dtype.code != kDLUInt || dl.dtype.bits != 8 ||
            dl.dtype.lanes != 1 || (dl.strides != nullptr && dl.strides[0] != 1)) {
          return "tensor " + std::to_string(v.source) + ": a shared storage that is not contiguous bytes in CPU memory";
        }
        // Aligned for any of the views' dtypes.
        storage = ownBytes(r, v.source, alignof(std::max_align_t));
        bytes += storage.nbytes();
      }
      if (v.offset + v.bytes > storage.nbytes()) {
        return "tensor " + std::to_string(i) + ": a view of bytes " + std::to_string(v.offset) + " to " +
            std::to_string(v.offset + v.bytes) + " of a shared storage of " + std::to_string(storage.nbytes());
      }
      type = v.type;
      int64_t item = static_cast<int64_t>(c10::elementSize(type));
      t = at::empty({0}, at::TensorOptions().dtype(type))
              .set_(storage.storage(), static_cast<int64_t>(v.offset) / item, v.shape, v.strides);
    } else {
      auto made = plainTensor(r, nextPlain++, i, flags[i], devices);
      if (auto* e = std::get_if<std::string>(&made)) {
        return std::move(*e);
      }
      t = std::move(std::get<at::Tensor>(made));
      type = t.scalar_type();
      bytes += t.nbytes();
    }
    if (flags[i] & kRequiresGrad) {
      if (!(at::isFloatingType(type) || at::isComplexType(type))) {
        return "tensor " + std::to_string(i) + ": requires_grad on a tensor of " + c10::toString(type);
      }
      t.set_requires_grad(true);
    }
    tensors.push_back(std::move(t));
  }
  stats.received += 1;
  stats.bytesReceived += bytes;
  auto type = static_cast<MessageType>(h.type);
  return c10::make_intrusive<Message>(std::move(payload), std::move(tensors), type, h.id);
}

// Sends `m` on `pipe` to worker `to`, its CUDA tensors where `map` says; `done(error)` runs on a
// library thread if the write fails.
void write(const std::shared_ptr<Pipe>& pipe, const Message& m, int32_t from, Stats& stats, const DeviceMap& map,
           const std::string& to, std::function<void(int, std::string)> onError) {
  sluice_message* msg = encode(m, from, stats, map, to);
  if (!onError) {
    // Nobody listens for the end (a response: a failed write fails the pipe, and the caller
    // hears of it there), so none is delivered: a write that finishes at once wakes no thread.
    sluice_pipe_write(pipe->raw, msg, nullptr, nullptr);
    return;
  }
  struct Ctx {
    std::shared_ptr<Pipe> pipe;
    std::function<void(int, std::string)> onError;
  };
  auto* ctx = new Ctx{pipe, std::move(onError)};
  int s = sluice_pipe_write(
      pipe->raw, msg,
      [](int status, void* user) {
        std::unique_ptr<Ctx> c(static_cast<Ctx*>(user));
        if (status != SLUICE_OK && c->onError) {
          c->onError(status, lastError(status));
        }
      },
      ctx);
  if (s != SLUICE_OK) {
    std::unique_ptr<Ctx> c(ctx);
    if (c->onError) {
      c->onError(s, lastError(s));
    }
  }
}

// Reads messages from a pipe one after another without a thread of its own: each read's
// completion (on a library thread) handles the message, then starts the next read. `onMessage`
// gets the message and the streams its CUDA tensors were copied on (none for CPU-only ones) and
// returns whether to go on; `onEnd` runs once when the loop ends on an error (status and text).
// `live` counts the loops still running, so shutdown can wait for the last callback.
struct ReadLoop {
  std::shared_ptr<Pipe> pipe;
  std::function<bool(sluice_received*, Streams)> onMessage;
  std::function<void(int, std::string)> onEnd;
  std::shared_ptr<std::atomic<int64_t>> live;
  // The GPUs this worker receives on (the agent's devices): tensors for any other are refused.
  std::vector<c10::Device> devices;
  // The streams of the read in progress, one per GPU, taken from PyTorch's pool at its first
  // tensor for that GPU (reads of one loop never overlap).
  Streams streams;

  static void start(std::unique_ptr<ReadLoop> loop) {
    loop->live->fetch_add(1);
    next(loop.release());
  }

  static void next(ReadLoop* loop) {
    loop->streams.clear();
    int s = sluice_pipe_read_then_with(loop->pipe->raw, &ReadLoop::alloc, &ReadLoop::freeBytes, loop,
                                       &ReadLoop::done, loop);
    if (s != SLUICE_OK) {
      finish(loop, s, lastError(s));
    }
  }

  // Memory for a tensor bound for GPU `device`: a byte tensor from PyTorch's allocator, made on
  // this read's stream for that GPU (so the allocator orders its reuse after our copy), which
  // the library fills on that stream. The handle is a heap copy of the tensor.
  static int alloc(void* user, int32_t device, size_t len, void** data, size_t* stream, void** handle) {
    auto* loop = static_cast<ReadLoop*>(user);
    try {
      if (device < 0 || device > std::numeric_limits<c10::DeviceIndex>::max()) {
        TORCH_WARN("sluice: ", sluice_pipe_peer(loop->pipe->raw), " sent a tensor for cuda:", device);
        return 1;
      }
      c10::Device dev(c10::kCUDA, static_cast<c10::DeviceIndex>(device));
      if (std::find(loop->devices.begin(), loop->devices.end(), dev) == loop->devices.end()) {
        TORCH_WARN("sluice: ", sluice_pipe_peer(loop->pipe->raw), " sent a tensor for ", dev,
                   ", which is not among this worker's devices (set devices or device_maps)");
        return 1;
      }
      auto it = std::find_if(loop->streams.begin(), loop->streams.end(),
                             [&](const c10::Stream& s) { return s.device() == dev; });
      if (it == loop->streams.end()) {
        c10::impl::VirtualGuardImpl impl(c10::kCUDA);
        loop->streams.push_back(impl.getStreamFromGlobalPool(dev, /*isHighPriority=*/false));
        it = loop->streams.end() - 1;
      }
      c10::StreamGuard guard(*it);
      auto* bytes = new at::Tensor(at::empty({static_cast<int64_t>(len)}, at::TensorOptions().dtype(at::kByte).device(dev)));
      *data = bytes->data_ptr();
      *stream = reinterpret_cast<size_t>(it->native_handle());
      *handle = bytes;
      return 0;
    } catch (const std::exception& e) {
      TORCH_WARN("sluice: cannot allocate ", len, " bytes on cuda:", device, " for a received tensor: ", e.what());
      return 2;
    }
  }

  static void freeBytes(void* /*user*/, void* handle) {
    delete static_cast<at::Tensor*>(handle);
  }

  static void finish(ReadLoop* loop, int status, std::string why) {
    if (status != SLUICE_OK && loop->onEnd) {
      loop->onEnd(status, std::move(why));
    }
    auto live = loop->live;
    delete loop;
    live->fetch_sub(1);
  }

  static void done(int status, sluice_received* r, void* user) {
    auto* loop = static_cast<ReadLoop*>(user);
    if (status != SLUICE_OK) {
      finish(loop, status, lastError(status));
      return;
    }
    bool more = false;
    try {
      more = loop->onMessage(r, std::move(loop->streams));
    } catch (const std::exception& e) {
      TORCH_WARN("sluice: a received message could not be handled: ", e.what());
    }
    if (more) {
      next(loop);
    } else {
      finish(loop, SLUICE_OK, "");
    }
  }
};

class SluiceAgent : public RpcAgent {
 public:
  using Maps = std::map<std::string, std::map<std::string, std::string>>;

  SluiceAgent(const c10::intrusive_ptr<::c10d::Store>& store, std::string name, int64_t rank, int64_t worldSize,
              float timeoutSeconds, int64_t numWorkerThreads, const std::string& transports,
              const std::string& channels, const std::string& listenHost, const std::string& contextOptions,
              const Maps& deviceMaps, const std::vector<std::string>& devices)
      : RpcAgent(WorkerInfo(name, rank), std::make_unique<RequestCallbackImpl>(),
                 std::chrono::milliseconds(static_cast<int64_t>(timeoutSeconds * 1000))),
        store_(store),
        worldSize_(worldSize),
        static_(worldSize > 0),
        core_(std::make_shared<Core>()) {
    TORCH_CHECK(numWorkerThreads > 0, "num_worker_threads must be at least 1");
    TORCH_CHECK(static_ || (deviceMaps.empty() && devices.empty()),
                "the SLUICE backend carries CPU tensors only in a dynamic group (init_rpc without world_size): "
                "device_maps and devices need a static group");
    // Every member agrees on the kind of group: the first to start sets it in the store.
    std::string kind = static_ ? "static" : "dynamic";
    auto set = store_->compareSet("sluice/group_kind", {}, std::vector<uint8_t>(kind.begin(), kind.end()));
    TORCH_CHECK(std::string(set.begin(), set.end()) == kind,
                "RPC group mixes statically and dynamically initialized members which is not supported. "
                "This group is ", std::string(set.begin(), set.end()), " and ", workerInfo_.name_, " started as ",
                kind, ".");
    // A dynamic group: the caller holds PyTorch's membership token, so the members listed in the
    // store are the group, and this worker is added to the list.
    auto names = static_ ? collectNames(::c10d::PrefixStore("names", store_), workerInfo_.id_, workerInfo_.name_,
                                        static_cast<int>(worldSize))
                         : collectCurrentNames(::c10d::PrefixStore("names", store_), workerInfo_.id_, workerInfo_.name_);
    core_->pool = std::make_unique<c10::ThreadPool>(static_cast<int>(numWorkerThreads));
    if (!static_) {
      // Cleared by shutdownImpl before the agent goes: read loops may outlive it.
      core_->onLost = [this](worker_id_t id, const void* pipe) { memberLost(id, pipe); };
    }
    for (const auto& [n, id] : names) {
      core_->workers.emplace(id, std::make_shared<const WorkerInfo>(n, id));
      byName_.emplace(n, id);
    }
    // Whatever fails from here is published where the other workers wait for this one (its
    // device maps, its address), so their start fails with the reason instead of waiting out
    // the store's timeout.
    try {
      setUpDevices(deviceMaps, devices);
      // A worker without GPUs offers no CUDA channel, so it never makes a CUDA context (the
      // CUDA channels probe the GPUs when offered).
      std::string offered = channels.empty() && devices_.empty() ? "rdma,cma,multilane,basic" : channels;
      int s = sluice_context_new_with(transports.empty() ? nullptr : transports.c_str(),
                                      offered.empty() ? nullptr : offered.c_str(),
                                      contextOptions.empty() ? nullptr : contextOptions.c_str(), &ctx_);
      TORCH_CHECK(s == SLUICE_OK, "sluice: cannot make a context: ", lastError(s));
      std::string at = listenHost + ":0";
      s = sluice_listen(ctx_, at.c_str(), &listener_);
      TORCH_CHECK(s == SLUICE_OK, "sluice: cannot listen on ", at, ": ", lastError(s));
      address_ = sluice_listener_address(listener_);
    } catch (const std::exception& e) {
      std::string why = std::string(kFailed) + e.what();
      std::string me = std::to_string(workerInfo_.id_);
      ::c10d::PrefixStore maps("sluice/device_maps", store_);
      if (!maps.check({me})) {
        maps.set(me, why);
      }
      store_->set("sluice/addr/" + me, why);
      if (!static_) {
        // Off the dynamic group's list again (the caller still holds the token), so the next
        // worker to join does not try to reach this one.
        removeCurrentName(::c10d::PrefixStore("names", store_), workerInfo_.id_, workerInfo_.name_);
        leftStore_ = true;
      }
      release();
      throw;
    }
    store_->set("sluice/addr/" + std::to_string(workerInfo_.id_), address_);
  }

  ~SluiceAgent() override {
    // The base destructor would call the pure shutdownImpl: shut down here.
    if (rpcAgentRunning_.load()) {
      shutdown();
    }
    release();
  }

  c10::intrusive_ptr<JitFuture> send(const WorkerInfo& to, c10::intrusive_ptr<Message> message,
                                     const float rpcTimeoutSeconds, const DeviceMap& deviceMap) override {
    TORCH_CHECK(rpcAgentRunning_.load(), "Node ", workerInfo_.id_, " tried to send() a message of type ",
                message->type(), " but RPC is no longer running on this node.");
    TORCH_CHECK(message->isRequest(), "the SLUICE agent sends requests only (got message type ", message->type(), ")");
    // The map given (distributed autograd's reverse map for gradients), else ours for `to`.
    const DeviceMap& map = deviceMap.empty() ? mapTo(to.name_) : deviceMap;
    std::shared_ptr<Pipe> pipe;
    {
      std::shared_lock<std::shared_mutex> l(core_->membersMu);
      auto client = clients_.find(to.id_);
      TORCH_CHECK(client != clients_.end(), "sluice: no pipe to ", to.name_, " (id ", to.id_,
                  static_ ? ")" : "): it is not a member of the group (it left, or has not joined)");
      pipe = client->second;
    }
    auto future = c10::make_intrusive<JitFuture>(at::AnyClassType::get(), getDevices());
    int64_t id = nextId_++;
    message->setId(id);
    float secs = rpcTimeoutSeconds == kUnsetRpcTimeout
        ? std::chrono::duration<float>(getRpcTimeout()).count()
        : rpcTimeoutSeconds;
    auto now = Clock::now();
    {
      std::lock_guard<std::mutex> l(core_->mu);
      std::optional<Clock::time_point> deadline;
      if (secs > 0) {
        deadline = now + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(secs));
        bool first = core_->deadlines.empty() || *deadline < core_->deadlines.begin()->first;
        core_->deadlines.emplace(*deadline, id);
        if (first) {
          core_->timerCv.notify_all();
        }
      }
      core_->pending.emplace(id, Pending{future, to.id_, pipe.get(), now, deadline});
      core_->clientActive += 1;
    }
    std::weak_ptr<Core> weak = core_;
    std::string peer = to.name_;
    auto onError = [weak, id, peer, to = to.id_, via = pipe.get()](int status, std::string e) {
      if (auto core = weak.lock()) {
        if (connectionLost(status)) {
          core->lost(to, via);  // before the call fails, as a failed read does
        }
        if (auto p = core->take(id)) {
          core->fail(std::move(*p), "sluice: sending to " + peer + " failed: " + e);
        }
      }
    };
    try {
      write(pipe, *message, workerInfo_.id_, core_->stats, map, to.name_, onError);
    } catch (...) {
      if (auto p = core_->take(id)) {
        core_->finished();
      }
      throw;
    }
    return future;
  }

  const WorkerInfo& getWorkerInfo(const std::string& workerName) const override {
    std::shared_lock<std::shared_mutex> l(core_->membersMu);
    auto it = byName_.find(workerName);
    TORCH_CHECK(it != byName_.end(), workerInfo_.name_, " could not find destination worker ", workerName,
                " (the group has ", byName_.size(), " workers)");
    return *core_->workers.at(it->second);
  }

  const WorkerInfo& getWorkerInfo(worker_id_t id) const override {
    std::shared_lock<std::shared_mutex> l(core_->membersMu);
    auto it = core_->workers.find(id);
    TORCH_CHECK(it != core_->workers.end(), workerInfo_.name_, " could not find destination worker id ", id,
                " (the group has ", core_->workers.size(), " workers)");
    return *it->second;
  }

  std::vector<WorkerInfo> getWorkerInfos() const override {
    std::shared_lock<std::shared_mutex> l(core_->membersMu);
    std::vector<WorkerInfo> out;
    for (const auto& [id, w] : core_->workers) {
      out.push_back(*w);
    }
    return out;
  }

  bool isStaticGroup() const { return static_; }

  const c10::intrusive_ptr<::c10d::Store>& store() const { return store_; }

  // A dynamic group's membership changes, as PyTorch's `_update_group_membership` hands them to
  // every member (TensorPipe's agent has the same method): a worker that joined is connected to
  // (its address is in the store), one that leaves is no longer a destination. Calls already in
  // flight to a worker that leaves still get their answers: it leaves after its own calls
  // finished, and its pipe is closed when it shuts down (which fails whatever is left).
  void updateGroupMembership(const WorkerInfo& worker, bool isJoin) {
    TORCH_CHECK(!static_, "sluice: ", workerInfo_.name_, " is in a static group: its members cannot change");
    if (worker.id_ == workerInfo_.id_) {
      return;
    }
    std::shared_ptr<Pipe> old;
    if (isJoin) {
      std::string addr = store_->get_to_str("sluice/addr/" + std::to_string(worker.id_));
      TORCH_CHECK(addr.rfind(kFailed, 0) != 0, "sluice: ", worker.name_, " could not start: ",
                  addr.substr(std::strlen(kFailed)));
      sluice_pipe* raw = nullptr;
      int s = sluice_connect(ctx_, addr.c_str(), &raw);
      TORCH_CHECK(s == SLUICE_OK, "sluice: cannot connect to ", worker.name_, " at ", addr, ": ", lastError(s));
      auto pipe = std::make_shared<Pipe>(raw);
      {
        std::unique_lock<std::shared_mutex> l(core_->membersMu);
        if (closing_) {
          l.unlock();
          pipe->close();
          TORCH_CHECK(false, "sluice: ", workerInfo_.name_, " is shutting down: ", worker.name_, " cannot join it");
        }
        retireLocked(worker.id_, worker.name_);
        core_->workers.emplace(worker.id_, std::make_shared<const WorkerInfo>(worker.name_, worker.id_));
        byName_.emplace(worker.name_, worker.id_);
        auto& slot = clients_[worker.id_];
        old = std::move(slot);
        slot = pipe;
        channel_[worker.id_] = std::string(sluice_pipe_transport(raw)) + "/" + sluice_pipe_channel(raw);
        if (old) {
          departed_.push_back(old);  // kept until shutdown: no pipe address is reused meanwhile
        }
      }
      readClient(core_, pipe, worker.id_, live_, devices_);
    } else {
      std::unique_lock<std::shared_mutex> l(core_->membersMu);
      dropLocked(worker.id_, worker.name_);
    }
    if (old) {
      // A worker that joined again without leaving (it died): its old pipe's calls fail.
      old->close();
    }
  }

  // A barrier over the group that returns once no worker has a call in flight (the same
  // protocol as TensorPipe's agent: rounds of summed counts through the store).
  // In a dynamic group, join waits for this worker's own calls and the requests it serves (no
  // barrier with the others), and with `shutdown` takes it off the store's member list (PyTorch's shutdown holds the membership token around it,
  // after telling every other member that this one leaves).
  void join(bool shutdown, float /*timeout*/) override {
    if (!static_) {
      {
        // Its own calls answered, and the requests it serves answered (their responses handed
        // to their pipes), before it leaves.
        std::unique_lock<std::mutex> l(core_->mu);
        core_->idle.wait(l, [this] { return core_->clientActive == 0 && core_->serverActive == 0; });
      }
      if (shutdown && !leftStore_.exchange(true)) {
        removeCurrentName(::c10d::PrefixStore("names", store_), workerInfo_.id_, workerInfo_.name_);
      }
      return;
    }
    ::c10d::PrefixStore sync("sluice/join", store_);
    while (true) {
      {
        std::unique_lock<std::mutex> l(core_->mu);
        core_->idle.wait(l, [this] { return core_->clientActive == 0; });
      }
      syncCallCount(sync, static_cast<int>(worldSize_));
      int64_t mine;
      {
        std::lock_guard<std::mutex> l(core_->mu);
        mine = core_->clientActive;
      }
      int total = syncCallCount(sync, static_cast<int>(worldSize_), static_cast<int>(mine));
      if (total == 0) {
        if (shutdown) {
          syncCallCount(sync, static_cast<int>(worldSize_));
        }
        return;
      }
    }
  }

  void sync() override {}

  void startImpl() override {
    // Every worker's address first: one that could not start says so, and nothing has been
    // started here yet.
    // The members as they are now (in a dynamic group others join only after this worker has
    // started and told them, under PyTorch's membership token).
    std::vector<std::shared_ptr<const WorkerInfo>> members;
    {
      std::shared_lock<std::shared_mutex> l(core_->membersMu);
      for (const auto& [id, w] : core_->workers) {
        members.push_back(w);
      }
    }
    std::unordered_map<worker_id_t, std::string> addrs;
    for (const auto& w : members) {
      std::string addr = store_->get_to_str("sluice/addr/" + std::to_string(w->id_));
      TORCH_CHECK(addr.rfind(kFailed, 0) != 0, "sluice: ", w->name_, " could not start: ",
                  addr.substr(std::strlen(kFailed)));
      addrs.emplace(w->id_, std::move(addr));
    }
    acceptThread_ = std::thread([this] { acceptLoop(); });
    timerThread_ = std::thread([core = core_] { timeouts(core); });
    for (const auto& w : members) {
      const std::string& addr = addrs.at(w->id_);
      sluice_pipe* raw = nullptr;
      int s = sluice_connect(ctx_, addr.c_str(), &raw);
      if (s == SLUICE_IO && !static_ && w->id_ != workerInfo_.id_) {
        // Listed, but refusing connections: gone without leaving (it died, or shut down without
        // `graceful`). Off the list (this worker holds the membership token) and out of this
        // worker's group. Any other failure (a timeout, a peer that speaks another version)
        // fails the join, as in a static group: that member may be alive.
        TORCH_WARN("sluice: ", w->name_, " is on the group's list but cannot be reached at ", addr, " (",
                   lastError(s), "): it is dropped from the group");
        removeCurrentName(::c10d::PrefixStore("names", store_), w->id_, w->name_);
        std::unique_lock<std::shared_mutex> l(core_->membersMu);
        retireLocked(w->id_, w->name_);
        continue;
      }
      TORCH_CHECK(s == SLUICE_OK, "sluice: cannot connect to ", w->name_, " at ", addr, ": ", lastError(s));
      auto pipe = std::make_shared<Pipe>(raw);
      {
        std::unique_lock<std::shared_mutex> l(core_->membersMu);
        channel_[w->id_] = std::string(sluice_pipe_transport(raw)) + "/" + sluice_pipe_channel(raw);
        clients_.emplace(w->id_, pipe);
      }
      readClient(core_, pipe, w->id_, live_, devices_);
    }
    // A handler may call out: serve requests once this worker's own pipes are open.
    std::lock_guard<std::mutex> l(serversMu_);
    serving_ = true;
    for (auto& p : servers_) {
      readServer(p);
    }
  }

  void shutdownImpl() override {
    {
      std::lock_guard<std::mutex> l(core_->lostMu);
      core_->onLost = nullptr;
    }
    {
      std::lock_guard<std::mutex> l(core_->mu);
      core_->timerStop = true;
      core_->timerCv.notify_all();
    }
    if (timerThread_.joinable()) {
      timerThread_.join();
    }
    // Wake the accept thread with a pipe of our own, then stop listening.
    stopping_ = true;
    if (acceptThread_.joinable()) {
      sluice_pipe* wake = nullptr;
      if (sluice_connect(ctx_, address_.c_str(), &wake) == SLUICE_OK) {
        sluice_pipe_free(wake);
      }
      acceptThread_.join();
    }
    std::vector<std::shared_ptr<Pipe>> opened;
    {
      // No worker joins from here on (updateGroupMembership refuses): every pipe is in the list.
      std::unique_lock<std::shared_mutex> l(core_->membersMu);
      closing_ = true;
      for (auto& [id, pipe] : clients_) {
        opened.push_back(pipe);
      }
      opened.insert(opened.end(), departed_.begin(), departed_.end());
    }
    for (auto& pipe : opened) {
      pipe->close();
    }
    {
      std::lock_guard<std::mutex> l(serversMu_);
      for (auto& p : servers_) {
        p->close();
      }
    }
    // Closed pipes end their reads: wait for the last read callback to return.
    auto until = Clock::now() + std::chrono::seconds(10);
    while (live_->load() > 0 && Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (live_->load() > 0) {
      TORCH_WARN("sluice: ", live_->load(), " pipe reads still running 10 s after their pipes were closed");
    }
    core_->failWhere([](const Pending&) { return true; },
                     "RPC agent of " + workerInfo_.name_ + " is shutting down: the call was not answered");
    {
      std::lock_guard<std::mutex> l(core_->postMu);
      core_->stopped = true;
    }
    core_->pool->waitWorkComplete();
  }

  std::unordered_map<std::string, std::string> getMetrics() override {
    std::unordered_map<std::string, std::string> m;
    std::lock_guard<std::mutex> l(core_->mu);
    m["agent.num_pending_requests"] = std::to_string(core_->pending.size());
    m["agent.client_active_calls"] = std::to_string(core_->clientActive);
    m["agent.server_active_calls"] = std::to_string(core_->serverActive);
    m["agent.thread_pool_size"] = std::to_string(core_->pool->size());
    m["agent.messages_sent"] = std::to_string(core_->stats.sent.load());
    m["agent.messages_received"] = std::to_string(core_->stats.received.load());
    m["agent.bytes_sent"] = std::to_string(core_->stats.bytesSent.load());
    m["agent.bytes_received"] = std::to_string(core_->stats.bytesReceived.load());
    uint64_t served = core_->stats.served.load();
    if (served > 0) {
      m["agent.requests_served"] = std::to_string(served);
      m["agent.avg_request_queue_us"] = std::to_string(core_->stats.queuedNs.load() / 1e3 / served);
      m["agent.avg_request_serve_us"] = std::to_string(core_->stats.servedNs.load() / 1e3 / served);
    }
    {
      std::shared_lock<std::shared_mutex> members(core_->membersMu);
      for (const auto& [id, path] : channel_) {
        m["agent.pipe." + core_->nameLocked(id)] = path;
      }
    }
    for (const auto& [id, v] : core_->latency) {
      if (v.first > 0) {
        m["agent.avg_rpc_latency_us." + core_->name(id)] = std::to_string(v.second / v.first * 1e6);
      }
    }
    if (isGILProfilingEnabled()) {
      uint64_t n = gilWaits_.load();
      m["agent.gil_average_wait_time_us"] = std::to_string(n == 0 ? 0.0 : double(gilWaitUs_.load()) / n);
    }
    return m;
  }

  DeviceMap getDeviceMap(const WorkerInfo& dst) const override {
    return mapTo(dst.name_);
  }

  const std::vector<c10::Device>& getDevices() const override {
    return devices_;
  }

  void addGilWaitTime(const std::chrono::microseconds gilWaitTime) override {
    gilWaitUs_ += gilWaitTime.count();
    gilWaits_ += 1;
  }

  const std::string& address() const { return address_; }

 private:
  const DeviceMap& mapTo(const std::string& worker) const {
    static const DeviceMap none;
    auto it = maps_.find(worker);
    return it == maps_.end() ? none : it->second;
  }

  // Device maps as TensorPipe's agent keeps them: ours (to each worker), and the reverse of each
  // worker's map to us (how our responses to it go back), exchanged through the store; this
  // worker's devices are `devices`, else every local device a map names. Each must exist here.
  void setUpDevices(const Maps& deviceMaps, const std::vector<std::string>& devices) {
    // Every worker publishes its maps (or why it has none) before it reads anyone's: a worker
    // whose maps are wrong fails the others' start with its reason instead of leaving them
    // waiting in the store.
    ::c10d::PrefixStore maps("sluice/device_maps", store_);
    std::ostringstream mine;
    {
      for (const auto& [to, m] : deviceMaps) {
        TORCH_CHECK(byName_.count(to), "device_maps names ", to, ", which is not a worker of this group");
        DeviceMap& map = maps_[to];
        for (const auto& [from, dst] : m) {
          c10::Device a(from), b(dst);
          TORCH_CHECK(a.is_cuda() && b.is_cuda() && a.has_index() && b.has_index(),
                      "device_maps map CUDA devices with an index to CUDA devices with an index; got ", a, " -> ", b,
                      " for ", to);
          for (const auto& [x, y] : map) {
            TORCH_CHECK(y != b, "device_maps map both ", x, " and ", a, " to ", b, " on ", to, " (one to one only)");
          }
          map.emplace(a, b);
          mine << to << ' ' << a << ' ' << b << '\n';
        }
      }
    }
    maps.set(std::to_string(workerInfo_.id_), mine.str());
    std::vector<c10::Device> local;
    auto add = [](std::vector<c10::Device>& v, const c10::Device& d) {
      if (std::find(v.begin(), v.end(), d) == v.end()) {
        v.push_back(d);
      }
    };
    for (const auto& [to, m] : maps_) {
      for (const auto& [a, b] : m) {
        add(local, a);
      }
    }
    for (const auto& [id, w] : core_->workers) {
      std::string published = maps.get_to_str(std::to_string(id));
      TORCH_CHECK(published.rfind(kFailed, 0) != 0, "sluice: ", w->name_, " could not start: ",
                  published.substr(std::strlen(kFailed)));
      std::istringstream theirs(published);
      std::string to, a, b;
      while (theirs >> to >> a >> b) {
        if (to != workerInfo_.name_) {
          continue;
        }
        c10::Device from(a), here(b);
        reverse_[id].emplace(here, from);
        add(local, here);
      }
    }
    if (!devices.empty()) {
      std::vector<c10::Device> given;
      for (const auto& d : devices) {
        c10::Device dev(d);
        TORCH_CHECK(dev.is_cuda(), "devices lists CUDA devices; got ", dev);
        add(given, dev);
      }
      for (const auto& d : local) {
        TORCH_CHECK(std::find(given.begin(), given.end(), d) != given.end(), "device_maps use ", d,
                    " here, which devices does not list");
      }
      local = given;
    }
    if (local.empty()) {
      return;  // CPU only: CUDA is never touched
    }
    int64_t count = 0;
    try {
      count = c10::impl::VirtualGuardImpl(c10::kCUDA).deviceCount();
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "device_maps/devices name ", local.front(), ", but this PyTorch has no CUDA: ", e.what());
    }
    std::sort(local.begin(), local.end(), [](const c10::Device& x, const c10::Device& y) { return x.index() < y.index(); });
    for (const auto& d : local) {
      TORCH_CHECK(d.has_index() && d.index() < count, "device_maps/devices name ", d, ", and this worker has ", count,
                  " GPU(s)");
      devices_.push_back(d);
    }
  }

  void release() {
    if (listener_) {
      sluice_listener_free(listener_);
      listener_ = nullptr;
    }
    {
      std::unique_lock<std::shared_mutex> l(core_->membersMu);
      clients_.clear();
      departed_.clear();
    }
    if (ctx_) {
      sluice_context_free(ctx_);
      ctx_ = nullptr;
    }
  }

  void acceptLoop() {
    while (!stopping_) {
      sluice_pipe* raw = nullptr;
      int s = sluice_listener_accept(listener_, &raw);
      if (s != SLUICE_OK) {
        continue;  // one peer's failed setup; keep listening
      }
      if (stopping_) {
        sluice_pipe_free(raw);
        return;
      }
      auto pipe = std::make_shared<Pipe>(raw);
      std::lock_guard<std::mutex> l(serversMu_);
      servers_.push_back(pipe);
      if (serving_) {
        readServer(pipe);
      }
    }
  }

  // Requests in, responses out on the same pipe. Requests run on the pool (`this` is used only
  // there: nothing is posted once shutdown has begun to wait for the pool).
  void readServer(std::shared_ptr<Pipe> pipe) {
    auto core = core_;
    std::string from = sluice_pipe_peer(pipe->raw);
    int32_t self = workerInfo_.id_;
    auto loop = std::make_unique<ReadLoop>();
    loop->pipe = pipe;
    loop->live = live_;
    // The caller went away (or we are shutting down): its calls fail on its side.
    loop->onEnd = nullptr;
    loop->devices = devices_;
    // What the read callbacks use, copied: `this` is used only on the pool (below).
    auto reverse = std::make_shared<const std::unordered_map<worker_id_t, DeviceMap>>(reverse_);
    auto devices = std::make_shared<const std::vector<c10::Device>>(devices_);
    loop->onMessage = [this, core, pipe, from, self, reverse, devices](sluice_received* r, Streams streams) {
      Header h{};
      auto decoded = decode(r, h, core->stats, *devices);
      sluice_received_free(r);
      if (auto* error = std::get_if<std::string>(&decoded)) {
        TORCH_WARN("sluice: closing the pipe from ", from, ": it sent ", *error);
        pipe->close();
        return false;
      }
      auto request = std::get<c10::intrusive_ptr<Message>>(decoded);
      if (!request->isRequest()) {
        TORCH_WARN("sluice: closing the pipe from ", from, ": it sent a message of type ", request->type(),
                   " where requests come");
        pipe->close();
        return false;
      }
      {
        std::lock_guard<std::mutex> l(core->mu);
        core->serverActive += 1;
      }
      auto arrived = Clock::now();
      // Responses to the caller go back through the reverse of its map to us (the worker the
      // header names: a peer naming another gets that one's map for its own responses).
      auto back = reverse->find(h.from);
      DeviceMap map = back == reverse->end() ? DeviceMap{} : back->second;
      std::string caller = core->name(h.from);
      core->post([this, core, pipe, request, self, arrived, streams = std::move(streams), map = std::move(map),
                  caller]() mutable { serve(core, pipe, request, self, arrived, std::move(streams), map, caller); });
      return true;
    };
    ReadLoop::start(std::move(loop));
  }

  // Runs a request's callback with the streams its CUDA tensors arrived on current (TensorPipe's
  // agent does the same), and answers through `map` (the reverse of the caller's map).
  void serve(const std::shared_ptr<Core>& core, const std::shared_ptr<Pipe>& pipe,
             const c10::intrusive_ptr<Message>& request, int32_t self, Clock::time_point arrived, Streams streams,
             DeviceMap map, std::string caller) {
    int64_t id = request->id();
    auto ns = [](Clock::duration d) { return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(d).count()); };
    core->stats.queuedNs += ns(Clock::now() - arrived);
    c10::intrusive_ptr<JitFuture> fut;
    {
      std::optional<c10::MultiStreamGuard> guard;
      if (!streams.empty()) {
        guard.emplace(streams);
      }
      try {
        fut = (*cb_)(*request, streams);
      } catch (const std::exception&) {
        fut = c10::make_intrusive<JitFuture>(at::AnyClassType::get());
        fut->setError(std::current_exception());
      }
    }
    // The callback runs with streams the future made wait for its value current (not the
    // request's streams, which may not have: a value completed later, elsewhere): the response's
    // tensors are read in their order.
    fut->addCallback([core, pipe, id, self, arrived, ns, map, caller](JitFuture& f) {
      // An error answer: CPU only, so nothing can stop it but the pipe itself.
      auto answerError = [core, pipe, id, self, caller](const std::string& what) {
        try {
          write(pipe, *createExceptionResponse(what, id), self, core->stats, {}, caller, nullptr);
        } catch (...) {
          pipe->close();  // the caller's calls fail on its side: nothing is left waiting
        }
      };
      try {
        auto response = f.hasError() ? createExceptionResponse(f.tryRetrieveErrorMessage(), id)
                                     : f.value().toCustomClass<Message>();
        response->setId(id);
        for (const auto& t : response->tensors()) {
          const auto& devices = f.devices();
          if (t.is_cuda() && std::find(devices.begin(), devices.end(), t.device()) == devices.end()) {
            // Its stream order is unknown here (TensorPipe refuses it too).
            answerError(c10::str("RPC detected that a user-function output tensor on device ", t.device(),
                                 ". This device is not one of the input tensor devices, which is not yet supported."));
            return;
          }
        }
        // A write that fails later (a GPU pair no channel connects, memory for a staging copy)
        // does not always fail the pipe: answer with the error instead.
        std::function<void(int, std::string)> onError = nullptr;
        if (!response->tensors().empty()) {
          onError = [answerError](int, std::string e) { answerError("sluice: the response could not be sent: " + e); };
        }
        write(pipe, *response, self, core->stats, map, caller, onError);
      } catch (const std::exception& e) {
        // A response Sluice cannot carry (an unmapped CUDA tensor, say) goes back as the error.
        answerError(e.what());
      }
      core->stats.servedNs += ns(Clock::now() - arrived);
      core->stats.served += 1;
      std::lock_guard<std::mutex> l(core->mu);
      if (--core->serverActive == 0 && core->clientActive == 0) {
        core->idle.notify_all();
      }
    });
  }

  // Responses in on a pipe this worker opened; any failure fails the calls that used it.
  static void readClient(std::shared_ptr<Core> core, std::shared_ptr<Pipe> pipe, worker_id_t peer,
                         std::shared_ptr<std::atomic<int64_t>> live, std::vector<c10::Device> devices) {
    auto peerName = core->name(peer);
    // The calls that went on this pipe (a worker that left and joined again has a new one).
    auto failAll = [core, via = pipe.get()](const std::string& why) {
      core->failWhere([via](const Pending& p) { return p.via == via; }, why);
    };
    auto loop = std::make_unique<ReadLoop>();
    loop->pipe = pipe;
    loop->live = std::move(live);
    loop->onEnd = [core, peer, via = pipe.get(), failAll, peerName](int status, std::string why) {
      if (connectionLost(status)) {
        core->lost(peer, via);  // first: by the time a call fails, the member is gone
      }
      failAll("sluice: the pipe to " + peerName + " failed: " + why);
    };
    loop->devices = devices;
    loop->onMessage = [core, pipe, peerName, failAll, devices](sluice_received* r, Streams streams) {
      Header h{};
      auto decoded = decode(r, h, core->stats, devices);
      sluice_received_free(r);
      if (auto* error = std::get_if<std::string>(&decoded)) {
        pipe->close();
        failAll("sluice: " + peerName + " sent " + *error + "; its pipe was closed");
        return false;
      }
      auto response = std::get<c10::intrusive_ptr<Message>>(decoded);
      if (!response->isResponse()) {
        pipe->close();
        failAll("sluice: " + peerName + " sent a message that is not a response; its pipe was closed");
        return false;
      }
      core->complete(h.id, response, std::move(streams));
      return true;
    };
    ReadLoop::start(std::move(loop));
  }

  static void timeouts(std::shared_ptr<Core> core) {
    std::unique_lock<std::mutex> l(core->mu);
    while (!core->timerStop) {
      if (core->deadlines.empty()) {
        core->timerCv.wait(l);
        continue;
      }
      auto next = core->deadlines.begin()->first;
      if (Clock::now() < next) {
        core->timerCv.wait_until(l, next);
        continue;
      }
      // Only pending calls have deadlines: a call that completes removes its own.
      std::vector<std::pair<Pending, int64_t>> expired;
      auto now = Clock::now();
      while (!core->deadlines.empty() && core->deadlines.begin()->first <= now) {
        int64_t id = core->deadlines.begin()->second;
        auto it = core->pending.find(id);
        if (it == core->pending.end()) {
          core->deadlines.erase(core->deadlines.begin());
          continue;
        }
        auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - it->second.started).count();
        expired.emplace_back(core->takeLocked(it), ms);
      }
      l.unlock();
      for (auto& [p, ms] : expired) {
        std::string text = "RPC ran for more than set timeout (" + std::to_string(ms) +
            " ms) and will now be marked with an error";
        core->fail(std::move(p), makeRPCError(text, RPCErrorType::TIMEOUT));
      }
      l.lock();
    }
  }

  // A dynamic group's member whose pipe from this worker failed: no longer a destination (a pipe
  // of the past, one that member had before it left or joined again, changes nothing).
  void memberLost(worker_id_t id, const void* pipe) {
    std::unique_lock<std::shared_mutex> l(core_->membersMu);
    auto it = clients_.find(id);
    if (it != clients_.end() && it->second.get() == pipe) {
      dropLocked(id, core_->nameLocked(id));
    }
  }

  // Under core_->membersMu: worker `id` is no longer a member or a destination (its pipe is kept
  // in departed_ until shutdown).
  void dropLocked(worker_id_t id, const std::string& name) {
    auto it = clients_.find(id);
    if (it != clients_.end()) {
      departed_.push_back(std::move(it->second));
      clients_.erase(it);
    }
    channel_.erase(id);
    retireLocked(id, name);
  }

  // Under core_->membersMu: moves worker `id` (if a member) to the retired list, and its name.
  void retireLocked(worker_id_t id, const std::string& name) {
    auto it = core_->workers.find(id);
    if (it != core_->workers.end()) {
      auto byName = byName_.find(it->second->name_);
      if (byName != byName_.end() && byName->second == id) {
        byName_.erase(byName);
      }
      core_->retired.push_back(std::move(it->second));
      core_->workers.erase(it);
    }
    auto other = byName_.find(name);
    TORCH_CHECK(other == byName_.end(), "sluice: worker name ", name, " is taken by worker id ", other->second,
                " (and worker id ", id, " asked for it)");
  }

  c10::intrusive_ptr<::c10d::Store> store_;
  int64_t worldSize_;
  const bool static_;                     // world_size given: the members never change
  std::atomic<bool> leftStore_{false};    // a dynamic member's name is off the store's list
  bool closing_ = false;                  // under core_->membersMu: shutdown took the pipes' list
  std::shared_ptr<Core> core_;
  // Under core_->membersMu (with core_->workers): names, the pipes this worker opened, and their
  // transport/channel; the pipes to members that left (or joined again), closed at shutdown.
  std::unordered_map<std::string, worker_id_t> byName_;
  std::unordered_map<std::string, DeviceMap> maps_;    // ours, by destination name
  std::unordered_map<worker_id_t, DeviceMap> reverse_;  // how responses to each caller go back
  std::vector<c10::Device> devices_;                    // the GPUs this worker sends from and receives on
  sluice_context* ctx_ = nullptr;
  sluice_listener* listener_ = nullptr;
  std::string address_;
  std::atomic<bool> stopping_{false};
  std::thread acceptThread_;
  std::thread timerThread_;
  std::unordered_map<worker_id_t, std::shared_ptr<Pipe>> clients_;
  std::unordered_map<worker_id_t, std::string> channel_;
  std::vector<std::shared_ptr<Pipe>> departed_;
  std::mutex serversMu_;
  std::vector<std::shared_ptr<Pipe>> servers_;
  bool serving_ = false;  // under serversMu_: every client pipe is open, server pipes are read
  std::shared_ptr<std::atomic<int64_t>> live_ = std::make_shared<std::atomic<int64_t>>(0);
  std::atomic<int64_t> nextId_{0};
  std::atomic<uint64_t> gilWaitUs_{0};
  std::atomic<uint64_t> gilWaits_{0};
};

// process_group.cpp: the c10d backend "sluice".
void bindProcessGroup(py::module& m);

}  // namespace sluice_torch

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using sluice_torch::SluiceAgent;
  namespace rpc = torch::distributed::rpc;
  py::module_::import("torch.distributed.rpc");
  py::class_<SluiceAgent, rpc::RpcAgent, std::shared_ptr<SluiceAgent>>(m, "SluiceAgent")
      .def(py::init([](const c10::intrusive_ptr<::c10d::Store>& store, const std::string& name, int64_t rank,
                       int64_t worldSize, float timeout, int64_t threads, const std::string& transports,
                       const std::string& channels, const std::string& host, const std::string& options,
                       const SluiceAgent::Maps& deviceMaps, const std::vector<std::string>& devices) {
             return std::shared_ptr<SluiceAgent>(
                 new SluiceAgent(store, name, rank, worldSize, timeout, threads, transports, channels, host, options,
                                 deviceMaps, devices),
                 torch::impl::destroy_without_gil<SluiceAgent>);
           }),
           py::arg("store"), py::arg("name"), py::arg("rank"), py::arg("world_size"), py::arg("rpc_timeout"),
           py::arg("num_worker_threads"), py::arg("transports"), py::arg("channels"), py::arg("host"), py::arg("context_options"),
           py::arg("device_maps"), py::arg("devices"),
           py::call_guard<py::gil_scoped_release>())
      // Defined here again with the id form (which RpcAgent's binding lacks and the int
      // destinations of rpc_sync need): a name on the subclass hides the base's overloads.
      .def("get_worker_info", py::overload_cast<>(&rpc::RpcAgent::getWorkerInfo, py::const_),
           py::call_guard<py::gil_scoped_release>())
      .def("get_worker_info", py::overload_cast<const std::string&>(&SluiceAgent::getWorkerInfo, py::const_),
           py::call_guard<py::gil_scoped_release>())
      .def("get_worker_info", py::overload_cast<rpc::worker_id_t>(&SluiceAgent::getWorkerInfo, py::const_),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("address", &SluiceAgent::address)
      .def_property_readonly("is_static_group", &SluiceAgent::isStaticGroup)
      .def_property_readonly("store", &SluiceAgent::store)
      // What PyTorch's `_update_group_membership` calls on every member of a dynamic group (its
      // device lists and reverse maps are empty: such a group carries CPU tensors only).
      .def("_update_group_membership",
           [](SluiceAgent& agent, const rpc::WorkerInfo& worker, const py::object& /*devices*/,
              const py::object& /*reverseDeviceMaps*/, bool isJoin) {
             py::gil_scoped_release release;
             agent.updateGroupMembership(worker, isJoin);
           },
           py::arg("worker_info"), py::arg("my_devices"), py::arg("reverse_device_map"), py::arg("is_join"));
#ifndef SLUICE_TORCH_RPC_ONLY
  sluice_torch::bindProcessGroup(m);
#endif
}
