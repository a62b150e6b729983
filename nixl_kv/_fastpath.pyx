# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The compiled steps of the request path (DESIGN section 9), built with the package (setup.py, Cython).

There is no pure-Python copy of anything here: ``nixl_kv.params_seal`` and ``nixl_kv.wire`` call these.

- The params' seal (``params_seal``): BLAKE2b (RFC 7693), 8-byte digest, personalization ``nixl_kv-params``, over
  the encoded params less their last 8 bytes, the top bit set; the same bytes ``hashlib.blake2b`` gives, computed
  over the caller's buffer without copying it. Its check takes any value: what is not a C-contiguous buffer of
  bytes, or is longer than ``MAX_PARAMS_BYTES``, is refused first, in O(1) time and allocating nothing.
- ``FlatDecoder``: the checking decoder of a *flat* dataclass of the data model (every field an int, a bool, bytes,
  a str, a tuple of ints or a tuple of tuples of ints, each optionally None): the params and every control message.
  ``wire`` works out each field's rule from the type hints and metadata and hands them over; the checks, their order
  and their messages are the generic decoder's, so a flat message decodes (or is refused, naming the same field
  with the same problem) exactly as before.
"""

from cpython.buffer cimport (
    PyBUF_RECORDS_RO,
    PyBUF_SIMPLE,
    PyBuffer_IsContiguous,
    PyBuffer_Release,
    PyObject_CheckBuffer,
    PyObject_GetBuffer,
)
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.long cimport PyLong_AsLongLongAndOverflow
from libc.stdint cimport uint8_t, uint64_t
from libc.string cimport memcpy, memset

import dataclasses

from nixl_kv.errors import WireFormatError

# --- BLAKE2b (RFC 7693) ----------------------------------------------------------------------------------------
cdef uint64_t[8] _IV = [
    0x6A09E667F3BCC908ULL, 0xBB67AE8584CAA73BULL, 0x3C6EF372FE94F82BULL, 0xA54FF53A5F1D36F1ULL,
    0x510E527FADE682D1ULL, 0x9B05688C2B3E6C1FULL, 0x1F83D9ABFB41BD6BULL, 0x5BE0CD19137E2179ULL,
]
cdef uint8_t[12][16] _SIGMA = [
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
    [14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3],
    [11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4],
    [7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8],
    [9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13],
    [2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9],
    [12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11],
    [13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10],
    [6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5],
    [10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0],
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
    [14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3],
]

PARAMS_PERSON = b"nixl_kv-params"  # the seal's BLAKE2b personalization (at most 16 bytes, zero-padded)
cdef enum:
    SEAL_DIGEST_BYTES = 8  # the seal is the first 8 bytes of the digest
cdef uint64_t _TOP_BIT = 1ULL << 63
cdef uint8_t _UINT64 = 0xCF  # msgpack's uint64 marker: the checksum field's value always has its top bit set


cdef inline uint64_t _rotr(uint64_t x, int n) noexcept nogil:
    return (x >> n) | (x << (64 - n))


cdef inline uint64_t _load64(const uint8_t* p) noexcept nogil:
    cdef uint64_t v = 0
    cdef int i
    for i in range(8):
        v |= (<uint64_t>p[i]) << (8 * i)
    return v


cdef inline void _g(uint64_t* v, int a, int b, int c, int d, uint64_t x, uint64_t y) noexcept nogil:
    v[a] = v[a] + v[b] + x
    v[d] = _rotr(v[d] ^ v[a], 32)
    v[c] = v[c] + v[d]
    v[b] = _rotr(v[b] ^ v[c], 24)
    v[a] = v[a] + v[b] + y
    v[d] = _rotr(v[d] ^ v[a], 16)
    v[c] = v[c] + v[d]
    v[b] = _rotr(v[b] ^ v[c], 63)


cdef void _compress(uint64_t* h, const uint8_t* block, uint64_t t, bint last) noexcept nogil:
    cdef uint64_t[16] v
    cdef uint64_t[16] m
    cdef int i
    cdef const uint8_t* s
    for i in range(16):
        m[i] = _load64(block + 8 * i)
    for i in range(8):
        v[i] = h[i]
        v[i + 8] = _IV[i]
    v[12] ^= t  # the byte counter's low word (its high word stays 0: messages are far below 2**64 bytes)
    if last:
        v[14] = ~v[14]
    for i in range(12):
        s = _SIGMA[i]
        _g(v, 0, 4, 8, 12, m[s[0]], m[s[1]])
        _g(v, 1, 5, 9, 13, m[s[2]], m[s[3]])
        _g(v, 2, 6, 10, 14, m[s[4]], m[s[5]])
        _g(v, 3, 7, 11, 15, m[s[6]], m[s[7]])
        _g(v, 0, 5, 10, 15, m[s[8]], m[s[9]])
        _g(v, 1, 6, 11, 12, m[s[10]], m[s[11]])
        _g(v, 2, 7, 8, 13, m[s[12]], m[s[13]])
        _g(v, 3, 4, 9, 14, m[s[14]], m[s[15]])
    for i in range(8):
        h[i] ^= v[i] ^ v[i + 8]


cdef void _blake2b(const uint8_t* data, size_t size, const uint8_t* person16, int digest_bytes,
                   uint8_t* out) noexcept nogil:
    """Unkeyed BLAKE2b of ``size`` bytes, no salt, ``person16`` (16 bytes) as its personalization."""
    cdef uint64_t[8] h
    cdef uint8_t[128] tail
    cdef size_t done = 0
    cdef int i
    for i in range(8):
        h[i] = _IV[i]
    h[0] ^= 0x01010000ULL | <uint64_t>digest_bytes  # fanout 1, depth 1, no key
    h[6] ^= _load64(person16)
    h[7] ^= _load64(person16 + 8)
    while size - done > 128:
        _compress(h, data + done, done + 128, False)
        done += 128
    memset(tail, 0, 128)
    memcpy(tail, data + done, size - done)
    _compress(h, tail, size, True)
    for i in range(digest_bytes):
        out[i] = <uint8_t>(h[i // 8] >> (8 * (i % 8)))


def blake2b_digest(data, person=b"", int digest_size=64):
    """``hashlib.blake2b(data, digest_size=digest_size, person=person).digest()``, computed here (the tests compare
    the two)."""
    cdef Py_buffer view
    cdef uint8_t[16] person16
    cdef uint8_t[64] out
    cdef bytes person_bytes = bytes(person)
    if not 1 <= digest_size <= 64:
        raise ValueError("digest_size must be between 1 and 64")
    if len(person_bytes) > 16:
        raise ValueError("person must be at most 16 bytes")
    memset(person16, 0, 16)
    memcpy(person16, PyBytes_AS_STRING(person_bytes), len(person_bytes))
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        _blake2b(<const uint8_t*>view.buf, <size_t>view.len, person16, digest_size, out)
    finally:
        PyBuffer_Release(&view)
    return PyBytes_FromStringAndSize(<char*>out, digest_size)


cdef uint8_t[16] _PARAMS_PERSON16
memset(_PARAMS_PERSON16, 0, 16)
memcpy(_PARAMS_PERSON16, PyBytes_AS_STRING(PARAMS_PERSON), len(PARAMS_PERSON))


cdef inline uint64_t _params_digest(const uint8_t* body, size_t size) noexcept nogil:
    """The seal of a body: its 8-byte digest read big-endian, the top bit set."""
    cdef uint8_t[8] out
    cdef uint64_t value = 0
    cdef int i
    _blake2b(body, size, _PARAMS_PERSON16, SEAL_DIGEST_BYTES, out)
    for i in range(8):
        value = (value << 8) | out[i]
    return value | _TOP_BIT


def params_digest(body) -> int:
    """The seal of ``body`` (the encoded params less their last 8 bytes)."""
    cdef Py_buffer view
    PyObject_GetBuffer(body, &view, PyBUF_SIMPLE)
    try:
        return _params_digest(<const uint8_t*>view.buf, <size_t>view.len)
    finally:
        PyBuffer_Release(&view)


def seal(encoded) -> bytes:
    """Encoded params that end in a uint64 (the checksum, or its placeholder), that uint64 set to the checksum."""
    cdef Py_buffer view
    cdef bytes out
    cdef uint8_t* p
    cdef uint64_t value
    cdef int i
    PyObject_GetBuffer(encoded, &view, PyBUF_SIMPLE)
    try:
        if view.len < 9 or (<const uint8_t*>view.buf)[view.len - 9] != _UINT64:
            raise ValueError("the params do not end in their checksum field")
        value = _params_digest(<const uint8_t*>view.buf, <size_t>(view.len - 8))
        out = PyBytes_FromStringAndSize(<char*>view.buf, view.len)
    finally:
        PyBuffer_Release(&view)
    p = <uint8_t*>PyBytes_AS_STRING(out) + len(out) - 8
    for i in range(8):
        p[i] = <uint8_t>(value >> (8 * (7 - i)))
    return out


MAX_PARAMS_BYTES = 4 << 20  # params longer than this are refused before anything reads them (see params_seal)
cdef Py_ssize_t _MAX_PARAMS = MAX_PARAMS_BYTES
cdef enum:
    P_SEALED = 0
    P_NOT_BUFFER = 1  # not a bytes-like object at all: a str, an int, None, a list...
    P_TOO_LONG = 2
    P_NOT_BYTES = 3  # a buffer whose items are not bytes, or that is not C-contiguous
    P_UNSEALED = 4


cdef int _params_check(object data, Py_ssize_t* size) except -1:
    """Why ``data`` are no sealed params (P_SEALED when they are); ``size`` gets their length in bytes. The kind and
    the size are looked at before any byte (a buffer view is O(1) and allocates nothing)."""
    cdef Py_buffer view
    cdef const uint8_t* p
    cdef uint64_t carried = 0
    cdef int i
    cdef bytes format
    if not PyObject_CheckBuffer(data):
        return P_NOT_BUFFER
    try:
        PyObject_GetBuffer(data, &view, PyBUF_RECORDS_RO)
    except BufferError:
        return P_NOT_BYTES
    try:
        size[0] = view.len
        if view.len > _MAX_PARAMS:
            return P_TOO_LONG
        if view.itemsize != 1 or not PyBuffer_IsContiguous(&view, b"C"):
            return P_NOT_BYTES
        if view.format != NULL and not (view.format[0] in b"Bbc" and view.format[1] == 0):
            return P_NOT_BYTES
        p = <const uint8_t*>view.buf
        if view.len < 9 or p[view.len - 9] != _UINT64:
            return P_UNSEALED
        for i in range(8):
            carried = (carried << 8) | p[view.len - 8 + i]
        return P_SEALED if carried == _params_digest(p, <size_t>(view.len - 8)) else P_UNSEALED
    finally:
        PyBuffer_Release(&view)


def is_sealed(data) -> bool:
    """Whether ``data`` are a bytes-like object of at most MAX_PARAMS_BYTES that ends in the checksum of everything
    before it (False for any other value)."""
    cdef Py_ssize_t size = 0
    return _params_check(data, &size) == P_SEALED


def params_problem(data) -> str:
    """What is wrong with ``data`` as sealed params, completing "the params ...": "" when nothing."""
    cdef Py_ssize_t size = 0
    cdef int problem = _params_check(data, &size)
    if problem == P_SEALED:
        return ""
    if problem == P_NOT_BUFFER:
        return f"are not bytes but {type(data).__name__}"
    if problem == P_TOO_LONG:
        return f"are {size} bytes, over the limit of {MAX_PARAMS_BYTES} bytes"
    if problem == P_NOT_BYTES:
        return f"are a {type(data).__name__} whose items are not bytes (or not contiguous)"
    return "fail their checksum"


# --- flat dataclasses ------------------------------------------------------------------------------------------
cdef enum:
    K_INT = 0
    K_BOOL = 1
    K_BYTES = 2
    K_STR = 3
    K_INTS = 4  # tuple[int, ...]
    K_INTS2 = 5  # tuple[tuple[int, ...], ...]
    MAX_DEPTH = 16  # wire._MAX_DEPTH

# The field kinds by name, for wire, which works out each field's kind from its type hint.
KINDS = {"int": K_INT, "bool": K_BOOL, "bytes": K_BYTES, "str": K_STR, "ints": K_INTS, "ints2": K_INTS2}
DEPTH_LIMIT = MAX_DEPTH

cdef object _MISSING = object()


cdef str _at(str path, str name, Py_ssize_t i, Py_ssize_t j):
    """``path.name``, with ``[i]`` and ``[j]`` where given (>= 0): where a refused value sits."""
    cdef str where = f"{path}.{name}"
    if i >= 0:
        where += f"[{i}]"
    if j >= 0:
        where += f"[{j}]"
    return where


cdef class _Rule:
    cdef str name
    cdef int kind
    cdef bint optional
    cdef bint has_default
    cdef object lo  # bounds of an int, or of a tuple's ints
    cdef object hi
    cdef long long lo64  # the same, where they fit: the common case is compared without Python objects
    cdef long long hi64
    cdef bint lo_fits
    cdef bint hi_big  # hi is above the int64 range: every int64 at or above lo is within
    cdef Py_ssize_t limit  # bytes, characters, or items (the outer items of K_INTS2)
    cdef Py_ssize_t inner_limit  # K_INTS2: items of each inner tuple
    cdef object default  # the field's default (_MISSING: none), or its default factory's
    cdef object factory


cdef long long _I64_MAX = 9223372036854775807


cdef class FlatDecoder:
    """The checking decoder of one flat dataclass: called as ``decoder(value, path, depth)`` like wire's others.

    ``rules``: per field, in field order, ``(name, kind, optional, has_default, lo, hi, limit, inner_limit)``;
    ``show`` formats a refused value for a message (``wire._show``)."""

    cdef object _cls
    cdef list rules
    cdef frozenset names
    cdef bint checks
    cdef bint direct
    cdef object show

    def __init__(self, cls, rules, show):
        cdef _Rule rule
        self._cls = cls
        self.rules = []
        self.show = show
        names = []
        for name, kind, optional, has_default, lo, hi, limit, inner_limit in rules:
            if kind not in (K_INT, K_BOOL, K_BYTES, K_STR, K_INTS, K_INTS2):
                raise ValueError(f"{cls.__name__}.{name}: no flat rule for kind {kind!r}")
            rule = _Rule()
            rule.name, rule.kind, rule.optional, rule.has_default = name, kind, optional, has_default
            rule.lo, rule.hi, rule.limit, rule.inner_limit = lo, hi, limit, inner_limit
            rule.lo_fits = -_I64_MAX <= lo <= _I64_MAX
            rule.lo64 = lo if rule.lo_fits else 0
            rule.hi_big = hi > _I64_MAX
            rule.hi64 = _I64_MAX if rule.hi_big else (hi if hi >= -_I64_MAX else -_I64_MAX)
            self.rules.append(rule)
            names.append(name)
        self.names = frozenset(names)
        self.checks = hasattr(cls, "problems")
        fields = {spec.name: spec for spec in dataclasses.fields(cls)}
        for rule in self.rules:
            spec = fields[rule.name]
            rule.default = _MISSING if spec.default is dataclasses.MISSING else spec.default
            rule.factory = None if spec.default_factory is dataclasses.MISSING else spec.default_factory
        # Where the dataclass's own __init__ would only store each field (frozen or not, through object.__setattr__),
        # the fields go straight into a new instance's __dict__, in field order, as that __init__ leaves them: it
        # costs about as much as all the checks together.
        self.direct = (
            cls.__dataclass_params__.init
            and not hasattr(cls, "__post_init__")
            and "__slots__" not in vars(cls)
            and cls.__new__ is object.__new__
            and list(fields) == names
            and all(spec.init for spec in fields.values())
        )

    @property
    def cls(self):
        return self._cls

    @property
    def direct(self):
        """Whether it fills a new instance's __dict__ itself (else it calls the class)."""
        return self.direct

    def __call__(self, value, str path, int depth):
        cdef _Rule rule
        cdef dict body
        cdef dict kwargs = {}
        if depth > MAX_DEPTH:
            raise WireFormatError(path, "nested too deeply")
        if not isinstance(value, dict):
            raise WireFormatError(path, f"expected a map, got {self.show(value)}")
        body = <dict>value
        if not self.names.issuperset(body):
            unknown = next(key for key in body if key not in self.names)
            raise WireFormatError(f"{path}.{str(unknown)[:64]}", "unknown field")
        for rule in self.rules:
            item = body.get(rule.name, _MISSING)
            if item is _MISSING:
                if rule.has_default:
                    if self.direct:
                        kwargs[rule.name] = rule.default if rule.factory is None else rule.factory()
                    continue
                raise WireFormatError(f"{path}.{rule.name}", "missing")
            if item is None and rule.optional:
                kwargs[rule.name] = None
                continue
            kwargs[rule.name] = self._field(rule, item, path, depth + 1)
        if self.direct:
            obj = object.__new__(self._cls)
            obj.__dict__.update(kwargs)
        else:
            obj = self._cls(**kwargs)
        if self.checks:
            problems = obj.problems()
            if problems:
                raise WireFormatError(path, "; ".join(problems))
        return obj

    cdef object _field(self, _Rule rule, object item, str path, int depth):
        cdef int kind = rule.kind
        if kind == K_INT:
            self._int(rule, item, path, rule.name, -1, -1)
            return item
        if kind == K_BOOL:
            if item is not True and item is not False:
                raise WireFormatError(f"{path}.{rule.name}", f"expected a bool, got {self.show(item)}")
            return item
        if kind == K_BYTES:
            if not isinstance(item, bytes):
                raise WireFormatError(f"{path}.{rule.name}", f"expected bytes, got {self.show(item)}")
            if len(<bytes>item) > rule.limit:
                raise WireFormatError(f"{path}.{rule.name}", f"{len(<bytes>item)} bytes is too long")
            return item
        if kind == K_STR:
            if not isinstance(item, str):
                raise WireFormatError(f"{path}.{rule.name}", f"expected a string, got {self.show(item)}")
            if len(<str>item) > rule.limit:
                raise WireFormatError(f"{path}.{rule.name}", f"string of {len(<str>item)} characters is too long")
            return item
        if kind == K_INTS:
            return self._ints(rule, item, path, rule.limit, -1, depth)
        return self._ints2(rule, item, path, depth)

    cdef inline void _int(self, _Rule rule, object item, str path, str name, Py_ssize_t i, Py_ssize_t j) except *:
        """An int within the rule's bounds (else the message names ``path.name[i][j]``, as far as given)."""
        cdef int overflow = 0
        cdef long long v
        if type(item) is not int:
            raise WireFormatError(_at(path, name, i, j), f"expected an integer, got {self.show(item)}")
        if rule.lo_fits:
            v = PyLong_AsLongLongAndOverflow(item, &overflow)
            if overflow == 0 and v >= rule.lo64 and (rule.hi_big or v <= rule.hi64):
                return
            if overflow == 0 and v < rule.lo64:
                raise WireFormatError(_at(path, name, i, j), f"{item} is outside [{rule.lo}, {rule.hi}]")
        if not rule.lo <= item <= rule.hi:  # beyond int64, or bounds that are: compared as Python ints
            raise WireFormatError(_at(path, name, i, j), f"{item} is outside [{rule.lo}, {rule.hi}]")

    cdef tuple _ints(self, _Rule rule, object item, str path, Py_ssize_t limit, Py_ssize_t outer, int depth):
        cdef list values
        cdef Py_ssize_t k
        if depth > MAX_DEPTH:
            raise WireFormatError(_at(path, rule.name, outer, -1), "nested too deeply")
        if not isinstance(item, list):
            raise WireFormatError(_at(path, rule.name, outer, -1), f"expected an array, got {self.show(item)}")
        values = <list>item
        if len(values) > limit:
            raise WireFormatError(
                _at(path, rule.name, outer, -1), f"{len(values)} items exceeds the limit of {limit}"
            )
        for k in range(len(values)):
            if outer < 0:
                self._int(rule, values[k], path, rule.name, k, -1)
            else:
                self._int(rule, values[k], path, rule.name, outer, k)
        return tuple(values)

    cdef tuple _ints2(self, _Rule rule, object item, str path, int depth):
        cdef list values
        cdef Py_ssize_t k
        if depth > MAX_DEPTH:
            raise WireFormatError(f"{path}.{rule.name}", "nested too deeply")
        if not isinstance(item, list):
            raise WireFormatError(f"{path}.{rule.name}", f"expected an array, got {self.show(item)}")
        values = <list>item
        if len(values) > rule.limit:
            raise WireFormatError(f"{path}.{rule.name}", f"{len(values)} items exceeds the limit of {rule.limit}")
        return tuple([self._ints(rule, values[k], path, rule.inner_limit, k, depth + 1) for k in range(len(values))])



# --- the envelope --------------------------------------------------------------------------------------------------
cdef class MessageDecoder:
    """``wire.decode_one_of`` for one tuple of classes: the size limit, msgpack, the envelope (version, type tag),
    then the chosen class's decoder. ``wire`` makes one per tuple and hands over what it decides: its msgpack
    ``unpack``, its wire version and size limit, ``decoder_of(cls)`` (looked up at first use of a class) and
    ``show``."""

    cdef dict by_name
    cdef dict decoders
    cdef str names
    cdef object unpack
    cdef object version
    cdef Py_ssize_t max_bytes
    cdef object decoder_of
    cdef object show

    def __init__(self, tuple classes, unpack, version, Py_ssize_t max_bytes, decoder_of, show):
        self.by_name = {cls.__name__: cls for cls in classes}
        self.names = ", ".join(self.by_name)
        self.decoders = {}
        self.unpack, self.version, self.max_bytes = unpack, version, max_bytes
        self.decoder_of, self.show = decoder_of, show

    def __call__(self, data):
        cdef Py_ssize_t size
        cdef dict envelope
        if type(data) is bytes or type(data) is bytearray:
            size = len(data)
        elif isinstance(data, (bytes, bytearray, memoryview)):
            size = memoryview(data).nbytes
        else:
            raise WireFormatError("<message>", f"expected bytes, got {type(data).__name__}")
        if size > self.max_bytes:
            raise WireFormatError("<message>", f"{size} bytes exceeds the {self.max_bytes}-byte limit")
        try:
            decoded = self.unpack(data if type(data) is bytes else bytes(data))
        except Exception as exc:  # msgpack raises many unrelated types on garbage; all mean the same thing
            raise WireFormatError("<message>", f"not valid msgpack ({type(exc).__name__}: {exc})") from None
        if (
            not isinstance(decoded, dict)
            or len(<dict>decoded) != 3
            or "nixl_kv" not in decoded
            or "type" not in decoded
            or "body" not in decoded
        ):
            raise WireFormatError("<message>", "not a nixl_kv envelope (expected keys nixl_kv, type, body)")
        envelope = <dict>decoded
        version = envelope["nixl_kv"]
        if type(version) is not int or version != self.version:
            raise WireFormatError(
                "nixl_kv", f"unsupported wire version {version!r}, this build speaks {self.version}"
            )
        tag = envelope["type"]
        cls = self.by_name.get(tag) if isinstance(tag, str) else None
        if cls is None:
            raise WireFormatError("type", f"expected one of {self.names}, got {self.show(tag)}")
        decoder = self.decoders.get(cls)
        try:
            if decoder is None:
                decoder = self.decoders[cls] = self.decoder_of(cls)
            return decoder(envelope["body"], cls.__name__, 0)
        except WireFormatError:
            raise
        except RecursionError:
            raise WireFormatError(cls.__name__, "nested too deeply") from None


# --- encoding flat dataclasses -------------------------------------------------------------------------------------
cdef class FlatEncoder:
    """The plain (msgpack-ready) body of one flat dataclass, as ``wire._to_plain`` makes it: each field by name, in
    field order, less those equal to their default; tuples as lists. ``rules``: per field ``(name, has_default,
    default, plain)`` (``plain``: sent as it is, as wire's ``_fields`` says); ``to_plain`` is wire's, for any value
    that is not None, an int, a str, bytes, a bool, or a tuple of ints or of tuples of ints."""

    cdef tuple names
    cdef tuple has_defaults
    cdef tuple defaults
    cdef tuple plains
    cdef object to_plain

    def __init__(self, rules, to_plain):
        self.names = tuple(rule[0] for rule in rules)
        self.has_defaults = tuple(bool(rule[1]) for rule in rules)
        self.defaults = tuple(rule[2] for rule in rules)
        self.plains = tuple(bool(rule[3]) for rule in rules)
        self.to_plain = to_plain

    def __call__(self, obj):
        cdef dict body = {}
        cdef Py_ssize_t i
        for i in range(len(self.names)):
            name = self.names[i]
            item = getattr(obj, name)
            if not self.has_defaults[i] or item != self.defaults[i]:
                body[name] = item if self.plains[i] else self._plain(item)
        return body

    cdef object _plain(self, object item):
        cdef tuple values
        cdef object entry
        cdef list out
        if item is None or type(item) is int or type(item) is bytes or type(item) is str or type(item) is bool:
            return item
        if type(item) is tuple:
            values = <tuple>item
            if _all_ints(values):
                return list(values)
            out = []
            for entry in values:
                if type(entry) is tuple and _all_ints(<tuple>entry):
                    out.append(list(<tuple>entry))
                else:
                    out.append(self.to_plain(entry))
            return out
        return self.to_plain(item)


cdef inline bint _all_ints(tuple values):
    cdef object entry
    for entry in values:
        if type(entry) is not int:
            return False
    return True
