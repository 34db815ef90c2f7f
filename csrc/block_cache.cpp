// A small caching allocator for the ZeRO-3 gathered-parameter buffers on CPU.
//
// [Note: the gather cache]
// Stage 3 frees a unit's full parameter buffer after use by resizing its storage to 0 bytes and
// re-allocates it at the next gather (twice per step: forward and backward). On a GPU the CUDA
// caching allocator hands the same block back; on CPU each re-allocation of a multi-MB buffer is a
// fresh mmap whose pages the kernel zeroes on first touch (2 gloo ranks, 33.6M-param MLP: ZeRO-3
// 1.60x ZeRO-2 per step with glibc defaults, 1.12x when glibc keeps freed blocks). Storages made by
// zk_cached_empty() use this allocator instead: torch's CPU resize (at::native::resize_bytes_cpu)
// calls storage->allocator(), so resize_(0) returns the block here and the next resize_(n) takes
// it back, without page faults. The storage object itself is the same (autograd's saved views
// stay valid), only its block moves.
//
// Blocks are reused when at least the requested size and at most 1/4 larger. Freed blocks are kept
// while the cached total stays within the limit (set by the ZeRO layer from its gathered working
// set), otherwise returned to the system. One cache per process (like torch's CUDA allocator);
// thread safe (a storage may die on any thread). Blocks come from c10::alloc_cpu (64-byte aligned).

#include "fused_adam.h"

#include <c10/core/impl/alloc_cpu.h>
#include <c10/core/StorageImpl.h>

#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>

namespace {

class BlockCache final : public c10::Allocator {
 public:
  static BlockCache& get() {
    static BlockCache* inst = new BlockCache();  // leaked: storages may outlive static destructors
    return *inst;
  }

  c10::DataPtr allocate(size_t n) override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (n == 0) return {nullptr, nullptr, &release_fn, cpu};
    void* p = nullptr;
    size_t size = n;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = free_.lower_bound(n);
      if (it != free_.end() && it->first <= n + n / 4) {
        p = it->second;
        size = it->first;
        cached_ -= size;
        free_.erase(it);
        ++hits_;
      } else {
        ++misses_;
      }
    }
    if (p == nullptr) p = c10::alloc_cpu(n);
    {
      std::lock_guard<std::mutex> g(mu_);
      live_[p] = size;
      live_bytes_ += size;
    }
    return {p, p, &release_fn, cpu};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release_fn; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  void set_limit(int64_t bytes) {
    std::lock_guard<std::mutex> g(mu_);
    limit_ = static_cast<size_t>(bytes);
    trim_locked(limit_);
  }

  void empty() {
    std::lock_guard<std::mutex> g(mu_);
    trim_locked(0);
  }

  std::map<std::string, int64_t> stats() {
    std::lock_guard<std::mutex> g(mu_);
    return {{"cached_bytes", static_cast<int64_t>(cached_)},
            {"live_bytes", static_cast<int64_t>(live_bytes_)},
            {"limit_bytes", static_cast<int64_t>(limit_)},
            {"hits", hits_},
            {"misses", misses_}};
  }

 private:
  static void release_fn(void* p) {
    if (p != nullptr) get().release(p);
  }

  void release(void* p) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = live_.find(p);
    TORCH_INTERNAL_ASSERT(it != live_.end(), "zero_kernels block cache: unknown block");
    const size_t size = it->second;
    live_.erase(it);
    live_bytes_ -= size;
    if (cached_ + size <= limit_) {
      free_.emplace(size, p);
      cached_ += size;
    } else {
      c10::free_cpu(p);
    }
  }

  // Free cached blocks, largest first, until at most `keep` bytes stay cached.
  void trim_locked(size_t keep) {
    while (cached_ > keep && !free_.empty()) {
      auto it = std::prev(free_.end());
      cached_ -= it->first;
      c10::free_cpu(it->second);
      free_.erase(it);
    }
  }

  std::mutex mu_;
  std::multimap<size_t, void*> free_;      // size -> cached block
  std::unordered_map<void*, size_t> live_; // block in use -> its size
  size_t cached_ = 0, live_bytes_ = 0, limit_ = 0;
  int64_t hits_ = 0, misses_ = 0;
};

}  // namespace

at::Tensor zk_cached_empty(int64_t numel, at::ScalarType dtype) {
  const size_t nbytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  auto& cache = BlockCache::get();
  c10::Storage storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), nbytes, cache.allocate(nbytes), &cache,
      /*resizable=*/true));
  return at::empty({0}, at::TensorOptions().dtype(dtype)).set_(storage, 0, {numel}, {1});
}

void zk_cache_set_limit(int64_t bytes) { BlockCache::get().set_limit(bytes); }
void zk_cache_empty() { BlockCache::get().empty(); }
std::map<std::string, int64_t> zk_cache_stats() { return BlockCache::get().stats(); }
