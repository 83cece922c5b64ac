#include "llama-dev-table.h"

#include "llama-impl.h"

#include <cstdlib>
#include <cstring>

bool llama_dev_table::init(ggml_backend_buffer_type_t buft, int64_t width, int64_t n_entries, int64_t n_stream, const char * name) {
    static const bool fail = [] {
        const char * v = getenv("LLAMA_DEV_TABLE_FAIL_ALLOC");
        return v != nullptr && atoi(v) != 0;
    }();

    ggml_init_params params = {
        /*.mem_size   =*/ ggml_tensor_overhead(),
        /*.mem_buffer =*/ nullptr,
        /*.no_alloc   =*/ true,
    };
    ctx.reset(ggml_init(params));
    t = ggml_new_tensor_3d(ctx.get(), GGML_TYPE_F32, width, n_entries, n_stream);
    ggml_set_name(t, name);

    ggml_backend_buffer_t b = fail ? nullptr : ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), buft);
    if (b == nullptr) {
        LLAMA_LOG_WARN("%s: could not allocate the table %s (%.2f MiB in %s): its inputs are written whole each ubatch\n",
                __func__, name, ggml_nbytes(t)/1024.0/1024.0, ggml_backend_buft_name(buft));
        t = nullptr;
        ctx.reset();
        return false;
    }
    buf.reset(b);
    ggml_backend_buffer_clear(b, 0);
    LLAMA_LOG_DEBUG("%s: %s kept in %s (%.2f MiB)\n", __func__, name, ggml_backend_buffer_name(b), ggml_nbytes(t)/1024.0/1024.0);
    return true;
}

size_t llama_dev_table::total_size() const {
    return buf ? ggml_backend_buffer_get_size(buf.get()) : 0;
}

llama_dev_table_write llama_dev_table_write::build(ggml_context * ctx, const llama_dev_table & table, int64_t n, int64_t cap,
        int64_t s0, int64_t n_stream) {
    ggml_tensor * t = table.tensor();
    GGML_ASSERT(t != nullptr && n <= t->ne[1] && s0 + n_stream <= t->ne[2]);

    const int64_t w = t->ne[0];

    llama_dev_table_write res;
    res.n         = n;
    res.s0        = s0;
    res.n_entries = t->ne[1];

    ggml_tensor * win = ggml_view_3d(ctx, t, w, n, n_stream, t->nb[1], t->nb[2], s0*t->nb[2]);
    ggml_tensor * written;
    if (cap >= n) {
        res.cap = n;
        res.val = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, w, n, n_stream);
        ggml_set_input(res.val);
        written = ggml_cpy(ctx, res.val, win);
    } else {
        res.cap = cap;
        res.idx = ggml_new_tensor_2d(ctx, GGML_TYPE_I64, cap, n_stream);
        res.val = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, w, cap, n_stream);
        ggml_set_input(res.idx);
        ggml_set_input(res.val);
        // the streams' rows from s0: set_rows takes them as [w, n_entries, n_stream] with the indices per stream
        ggml_tensor * strm = ggml_view_3d(ctx, t, w, t->ne[1], n_stream, t->nb[1], t->nb[2], s0*t->nb[2]);
        written = ggml_set_rows(ctx, strm, res.val, res.idx);
        written = ggml_view_3d(ctx, written, w, n, n_stream, written->nb[1], written->nb[2], 0);
    }
    // the readers take the written table, so they run after the write; contiguous for their reshapes
    res.out = n_stream > 1 && n < t->ne[1] ? ggml_cont(ctx, written) : written;
    return res;
}
