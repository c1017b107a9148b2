/* The always-on isolation check (I3, I4) and the write records' growth, over the records of
 * kvseal/kvcache/records.py (WriteRecords), one call each per forward.
 *
 * Why. The same check in torch ops is about fifteen small ops a step (a gather over the batch's
 * pages, comparisons, reductions), and the records' growth four more; right after a decode call
 * has streamed ~500 MB through the caches, each of them costs several times its warm time
 * (0.5-0.8 ms a step at 32 rows, more at one row than its arithmetic). Here each is one pass
 * over the few hundred integers it needs.
 *
 * What it reads. The records (page_row, page_namespace, row_namespace, prefix) and the batch's
 * own tables, slots and positions; nothing else. Every page id and slot is bounds-checked
 * before it indexes the records: one outside the pool refuses its sequence. The result is the
 * torch formulation's (records.py keeps it for a backend without these kernels):
 * tests/kvcache/test_record_kernels.py holds the two to the same answer on random batches. */

#include "kvseal_ops.h"

/* Whether sequence i (record row `row`) may use `page`: its own page, or (a read only) a page
   held by the prefix cache under the row's namespace. */
static int may_use(const struct kvseal_records *r, int64_t row, int64_t page, int is_read) {
    if (page < 0 || page >= r->num_pages) return 0;
    const int64_t owner = r->page_row[page];
    if (owner == row) return 1;
    return is_read && owner == KVSEAL_CACHED_ROW && r->page_namespace[page] == r->row_namespace[row];
}

/* Why sequence i may not run (KVSEAL_REFUSE_*), 0 if it may. */
static int64_t refusal(const struct kvseal_records *r, int64_t row, int64_t start, const int64_t *pages,
                       int64_t num_pages, const int64_t *slots, int64_t num_slots) {
    if (row < 0 || row >= r->num_rows) return KVSEAL_REFUSE_NO_PAGES;
    for (int64_t p = 0; p < num_pages; p++)
        if (!may_use(r, row, pages[p], 1)) return KVSEAL_REFUSE_FOREIGN;
    for (int64_t s = 0; s < num_slots; s++)
        if (slots[s] < 0 || !may_use(r, row, slots[s] / r->page_size, 0)) return KVSEAL_REFUSE_FOREIGN;
    for (int64_t l = 0; l < r->num_layers; l++)
        if (r->prefix[l * r->num_rows + row] < start) return KVSEAL_REFUSE_UNCOVERED;
    return 0;
}

int64_t kvseal_check_forward(const struct kvseal_records *records, const int64_t *rows, const int64_t *starts,
                             int64_t num_seqs, const int64_t *pages, int64_t num_pages, const int64_t *page_counts,
                             const int64_t *slots, int64_t num_slots, const int64_t *slot_counts, int64_t *refused) {
    int64_t pages_named = 0, slots_named = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        if (page_counts[i] < 0 || slot_counts[i] < 0) return -1;
        pages_named += page_counts[i];
        slots_named += slot_counts[i];
    }
    if (pages_named != num_pages || slots_named != num_slots) return -1;
    int64_t num_refused = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        refused[i] = refusal(records, rows[i], starts[i], pages, page_counts[i], slots, slot_counts[i]);
        num_refused += refused[i] != 0;
        pages += page_counts[i];
        slots += slot_counts[i];
    }
    return num_refused;
}

void kvseal_advance_prefix(const struct kvseal_records *records, const int64_t *rows, const int64_t *starts,
                           const int64_t *ends, int64_t num_seqs, int64_t layer_begin, int64_t layer_end) {
    for (int64_t l = layer_begin < 0 ? 0 : layer_begin; l < layer_end && l < records->num_layers; l++) {
        int64_t *prefix = records->prefix + l * records->num_rows;
        for (int64_t i = 0; i < num_seqs; i++) {
            const int64_t row = rows[i];
            if (row < 0 || row >= records->num_rows || prefix[row] < starts[i]) continue;
            if (prefix[row] < ends[i]) prefix[row] = ends[i];
        }
    }
}
