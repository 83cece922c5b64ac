#pragma once

// moecache: a table of f32 values that stays in a backend buffer across graphs. A graph either writes
// every entry of its window (a copy of a full input, as an input written whole each ubatch would be)
// or only the entries that changed since the table last got them (set_rows of a small input), so a
// decode step at a long context uploads a few entries instead of one per cell.

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpp.h"

#include <cstdint>
#include <vector>

struct llama_dev_table {
    // n_entries rows of `width` values per stream, in a buffer of type buft; false if it cannot be
    // allocated (LLAMA_DEV_TABLE_FAIL_ALLOC=1 makes it fail, for the tests)
    bool init(ggml_backend_buffer_type_t buft, int64_t width, int64_t n_entries, int64_t n_stream, const char * name);

    bool ready() const { return t != nullptr; }

    int64_t width()     const { return t->ne[0]; }
    int64_t n_entries() const { return t->ne[1]; }

    ggml_tensor * tensor() const { return t; }

    size_t total_size() const;

private:
    ggml_context_ptr        ctx;
    ggml_backend_buffer_ptr buf;
    ggml_tensor *           t = nullptr; // F32 [width, n_entries, n_stream]
};

// what one graph writes into a table: the first n entries of the streams s0.. s0 + n_stream - 1
struct llama_dev_table_write {
    ggml_tensor * idx = nullptr; // I64 [cap, n_stream]: the entries written; null where every entry is
    ggml_tensor * val = nullptr; // F32 [width, cap, n_stream], or [width, n, n_stream] where every entry is
    ggml_tensor * out = nullptr; // F32 [width, n, n_stream]: the entries once written, contiguous

    int64_t n         = 0;
    int64_t cap       = 0; // entries per stream in the input: n where every entry is written
    int64_t s0        = 0;
    int64_t n_entries = 0; // the table's: a changed entry past the window is written too

    bool full() const { return idx == nullptr; }

    // the graph's write for n entries of n_stream streams from stream s0: cap < n writes at most cap
    // changed entries per stream, cap >= n every entry
    static llama_dev_table_write build(ggml_context * ctx, const llama_dev_table & table, int64_t n, int64_t cap,
            int64_t s0, int64_t n_stream);

    // stream s's input: every entry of the window (full) from `value`, or the given entries of the
    // table (at most cap; at least one, the rest padded with repeats of the first); value(e, k) is
    // entry e's k-th value
    template <typename F>
    void set(int64_t s, const std::vector<uint32_t> & entries, F && value) const {
        const int64_t w = val->ne[0];
        float * v = (float *) val->data + s*w*cap;
        if (full()) {
            for (int64_t e = 0; e < n; ++e) {
                for (int64_t k = 0; k < w; ++k) {
                    v[e*w + k] = value((uint32_t) e, k);
                }
            }
            return;
        }
        GGML_ASSERT(!entries.empty() && (int64_t) entries.size() <= cap);
        int64_t * ix = (int64_t *) idx->data + s*cap;
        for (int64_t i = 0; i < cap; ++i) {
            const uint32_t e = entries[i < (int64_t) entries.size() ? i : 0];
            GGML_ASSERT((int64_t) e < n_entries);
            ix[i] = e;
            for (int64_t k = 0; k < w; ++k) {
                v[i*w + k] = value(e, k);
            }
        }
    }

    bool same_shape(int64_t n_, int64_t cap_, int64_t s0_, int64_t n_stream) const {
        return n == n_ && cap == cap_ && s0 == s0_ && out->ne[2] == n_stream;
    }
};
