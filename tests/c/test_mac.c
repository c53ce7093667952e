/* Keyed BLAKE2s (src/blake2s.c) against known answers: RFC 7693's own
 * example, and keyed vectors from Python's hashlib.blake2s, an independent
 * implementation. Data lengths 0, 1, 63, 64, 65 and 200 cover the block
 * boundary, where the "compress only when more input follows" rule of
 * update and final is easiest to get wrong. */
#include "util/blake2s.h"
#include "task.h"

/* Keyed vectors: data byte i is i, key byte i is i (the pattern of the
 * BLAKE2 reference KAT, whose 32-byte-key entries these match). Made with
 *   hashlib.blake2s(bytes(range(n)), key=bytes(range(keylen)),
 *                   digest_size=outlen).hexdigest() */
typedef struct keyed_vector {
  size_t keylen, outlen, datalen;
  const char *hex;
} keyed_vector_t;

static const keyed_vector_t keyed_vectors[] = {
    {16, 16, 0, "af4e5d3bb230e9ff9096ca6f7c501f76"},
    {16, 16, 1, "881e42e7bb358082637c0a0fd7ec6c2f"},
    {16, 16, 63, "2151a1ac11ef2763a427614c612b3de0"},
    {16, 16, 64, "dd55c51c98f8ab96ed272882941f0b6a"},
    {16, 16, 65, "9018c671bb7e94a6d540a91765bbecad"},
    {16, 16, 200, "b8d300fa7937e4d1e67c8468df4c9a43"},
    {16, 32, 0,
     "fcfc1128807d157b01adec1ebe0a0927e5ac0ea65000fcec0852218dbb147106"},
    {16, 32, 1,
     "55085f9908bf12258f944533b26cc7171c7b537b05562d87dd6021f597d2692b"},
    {16, 32, 63,
     "306025cb3c58ecf6f013cf53bb2f3ee0821d9e4bedbba529484d42cd2e57727b"},
    {16, 32, 64,
     "02ba5ce93a26f31312dd2226e48e522df956817d30e797fc3dd232f6bfb5d6a2"},
    {16, 32, 65,
     "663c663b0a34211816968d004d286d543fcb1707bdde93bbd485cb225436aeff"},
    {16, 32, 200,
     "27064fea2cfcbc48cff3127060c3b9d071ac4debe6b44ae60537afa6d23720f2"},
    {32, 16, 0, "9536f9b267655743dee97b8a670f9f53"},
    {32, 16, 1, "13bacfb85b48a1223c595f8c1e7e82cb"},
    {32, 16, 63, "ece382a8bd5018f1de5da44b72cea75b"},
    {32, 16, 64, "f1efa90d2547036841ecd3627fafbc36"},
    {32, 16, 65, "811ff8686d23a435ecbd0bdafcd27b1b"},
    {32, 16, 200, "42a6f8ff590af21b512e9e088257aa34"},
    {32, 32, 0,
     "48a8997da407876b3d79c0d92325ad3b89cbb754d86ab71aee047ad345fd2c49"},
    {32, 32, 1,
     "40d15fee7c328830166ac3f918650f807e7e01e177258cdc0a39b11f598066f1"},
    {32, 32, 63,
     "c65382513f07460da39833cb666c5ed82e61b9e998f4b0c4287cee56c3cc9bcd"},
    {32, 32, 64,
     "8975b0577fd35566d750b362b0897a26c399136df07bababbde6203ff2954ed4"},
    {32, 32, 65,
     "21fe0ceb0052be7fb0f004187cacd7de67fa6eb0938d927677f2398c132317a8"},
    {32, 32, 200,
     "13c88480a5d00d6c8c7ad2110d76a82d9b70f4fa6696d4e5dd42a066dcaf9920"},
};

static void to_hex(const uint8_t *p, size_t n, char *hex) {
  static const char digits[] = "0123456789abcdef";
  for (size_t i = 0; i < n; i++) {
    hex[2 * i] = digits[p[i] >> 4];
    hex[2 * i + 1] = digits[p[i] & 15];
  }
  hex[2 * n] = '\0';
}

/* Hashes data in pieces of `chunk` bytes (all at once when chunk is 0) and
 * checks the digest against the expected hex, naming the case on failure. */
static void check_hash(const char *what, const void *key, size_t keylen,
                       size_t outlen, const uint8_t *data, size_t len,
                       size_t chunk, const char *expected) {
  usmipc__blake2s_t s;
  uint8_t out[32];
  char hex[65];
  usmipc__blake2s_init(&s, outlen, key, keylen);
  if (chunk == 0) {
    usmipc__blake2s_update(&s, data, len);
  } else {
    for (size_t off = 0; off < len; off += chunk)
      usmipc__blake2s_update(&s, data + off,
                             len - off < chunk ? len - off : chunk);
  }
  usmipc__blake2s_final(&s, out);
  to_hex(out, outlen, hex);
  ASSERT_MSG(strcmp(hex, expected) == 0,
             "%s (key %zu, out %zu, data %zu, chunk %zu): got %s, want %s",
             what, keylen, outlen, len, chunk, hex, expected);
  /* final wipes the state: it held the key block and the chained value. */
  static const usmipc__blake2s_t zero;
  ASSERT_MSG(memcmp(&s, &zero, sizeof(s)) == 0, "%s: state not wiped", what);
}

TEST_IMPL(mac_blake2s_vectors) {
  uint8_t data[200], key[32];
  for (size_t i = 0; i < sizeof(data); i++)
    data[i] = (uint8_t)i;
  for (size_t i = 0; i < sizeof(key); i++)
    key[i] = (uint8_t)i;

  /* RFC 7693 Appendix B: BLAKE2s-256("abc"); and the empty message. */
  check_hash("RFC 7693 abc", NULL, 0, 32, (const uint8_t *)"abc", 3, 0,
             "508c5e8c327c14e2e1a72ba34eeb452f"
             "37458b209ed63a294d999b4c86675982");
  check_hash("unkeyed empty", NULL, 0, 32, data, 0, 0,
             "69217a3079908094e11121d042354a7c"
             "1f55b6482ca1a51e1b250dfd1ed0eef9");

  /* Every keyed vector, at once and in pieces that straddle block ends in
   * different places (1: byte by byte; 64: whole blocks; 65: one over). */
  static const size_t chunks[] = {0, 1, 3, 63, 64, 65};
  for (size_t v = 0; v < sizeof(keyed_vectors) / sizeof(keyed_vectors[0]);
       v++) {
    const keyed_vector_t *kv = &keyed_vectors[v];
    for (size_t c = 0; c < sizeof(chunks) / sizeof(chunks[0]); c++)
      check_hash("keyed", key, kv->keylen, kv->outlen, data, kv->datalen,
                 chunks[c], kv->hex);
  }

  /* usmipc__mac is the 16-byte-key, 16-byte-tag case of the table. */
  for (size_t v = 0; v < sizeof(keyed_vectors) / sizeof(keyed_vectors[0]);
       v++) {
    const keyed_vector_t *kv = &keyed_vectors[v];
    if (kv->keylen != 16 || kv->outlen != 16)
      continue;
    uint8_t tag[16];
    char hex[33];
    usmipc__mac(tag, key, data, kv->datalen);
    to_hex(tag, sizeof(tag), hex);
    ASSERT_MSG(strcmp(hex, kv->hex) == 0, "mac of %zu bytes: got %s, want %s",
               kv->datalen, hex, kv->hex);
  }
  /* The precompressed key state gives the same tags, reused many times. */
  {
    usmipc__blake2s_t keyed;
    usmipc__mac_keyed_init(&keyed, key);
    for (int round = 0; round < 2; round++)
      for (size_t v = 0; v < sizeof(keyed_vectors) / sizeof(keyed_vectors[0]);
           v++) {
        const keyed_vector_t *kv = &keyed_vectors[v];
        if (kv->keylen != 16 || kv->outlen != 16 || kv->datalen == 0)
          continue;
        uint8_t tag[16];
        char hex[33];
        usmipc__mac_keyed(tag, &keyed, data, kv->datalen);
        to_hex(tag, sizeof(tag), hex);
        ASSERT_MSG(strcmp(hex, kv->hex) == 0,
                   "keyed-state mac of %zu bytes: got %s, want %s", kv->datalen,
                   hex, kv->hex);
      }
  }
  /* A NULL pointer with no data is an empty message. */
  {
    uint8_t tag[16], want[16];
    usmipc__mac(tag, key, NULL, 0);
    usmipc__mac(want, key, data, 0);
    ASSERT(memcmp(tag, want, sizeof(tag)) == 0);
  }

  /* usmipc__ct_equal: 1 for equal bytes (and for none), 0 for any single
   * flipped bit at any position, including the first and the last byte. */
  {
    uint8_t a[32], b[32];
    memcpy(a, data, sizeof(a));
    memcpy(b, data, sizeof(b));
    ASSERT_EQ(usmipc__ct_equal(a, b, sizeof(a)), 1);
    ASSERT_EQ(usmipc__ct_equal(a, b, 0), 1);
    ASSERT_EQ(usmipc__ct_equal(a, a, sizeof(a)), 1);
    for (size_t i = 0; i < sizeof(b); i++) {
      for (int bit = 0; bit < 8; bit++) {
        b[i] ^= (uint8_t)(1u << bit);
        ASSERT_MSG(usmipc__ct_equal(a, b, sizeof(a)) == 0,
                   "byte %zu bit %d differs but compared equal", i, bit);
        /* Outside the compared range the difference does not count. */
        ASSERT_EQ(usmipc__ct_equal(a, b, i), 1);
        b[i] ^= (uint8_t)(1u << bit);
      }
    }
    b[31] = (uint8_t)~a[31]; /* every bit of one byte */
    ASSERT_EQ(usmipc__ct_equal(a, b, sizeof(a)), 0);
  }
  return 0;
}
