"""Offline answers from the audit log (I8) for operators: `kvseal usage` (totals per tenant or
key, for billing) and `kvseal audit` (which requests, which tenants: an incident's questions).

Both read the file `kvseal serve --audit-log FILE` writes and its rotated files (`FILE.N`,
logrotate's `FILE-DATE`, and either as `.gz` where compressed), oldest first, each line once
(`kvseal.auditlog.logfiles` chooses the files); they never write. They read
the records with the writer's own struct (`kvseal.server.audit.AuditRecord`), so a field the
server writes is a field they know.
"""
