/* BLAKE2s as RFC 7693 specifies it (section 3 and Appendix C, the reference
 * code this follows). Portable on purpose: words are loaded and stored a byte
 * at a time, so the result does not depend on the host's byte order or on
 * alignment, and the compiler turns the loops into plain loads on
 * little-endian machines.
 *
 * Floor 1 of the core (util): a fixed computation, calling nothing. */
#include "blake2s.h"

#include <stdlib.h>
#include <string.h>

static const uint32_t blake2s_iv[8] = {
    0x6A09E667u, 0xBB67AE85u, 0x3C6EF372u, 0xA54FF53Au,
    0x510E527Fu, 0x9B05688Cu, 0x1F83D9ABu, 0x5BE0CD19u,
};

/* Message word permutations, one row per round (RFC 7693 section 2.7). */
static const uint8_t blake2s_sigma[10][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
};

static uint32_t load32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
         (uint32_t)p[3] << 24;
}

static uint32_t rotr32(uint32_t x, unsigned n) {
  return x >> n | x << (32 - n);
}

/* Overwrites n bytes in a way the compiler may not drop as a dead store
 * (a memset before the object's end of life may be removed). */
static void wipe(void *p, size_t n) {
  memset(p, 0, n);
  /* The compiler must assume the empty asm reads the memory behind p, so
   * the memset stays; this costs a few stores, not a byte loop. */
  __asm__ __volatile__("" : : "r"(p) : "memory");
}

/* The mixing function G (RFC 7693 section 3.1) with BLAKE2s's rotations. */
#define G(a, b, c, d, x, y)                                                    \
  do {                                                                         \
    v[a] = v[a] + v[b] + (x);                                                  \
    v[d] = rotr32(v[d] ^ v[a], 16);                                            \
    v[c] = v[c] + v[d];                                                        \
    v[b] = rotr32(v[b] ^ v[c], 12);                                            \
    v[a] = v[a] + v[b] + (y);                                                  \
    v[d] = rotr32(v[d] ^ v[a], 8);                                             \
    v[c] = v[c] + v[d];                                                        \
    v[b] = rotr32(v[b] ^ v[c], 7);                                             \
  } while (0)

/* The compression function F (section 3.2) on one 64-byte block; the byte
 * counter and final flag have been set by the caller. */
static void compress(usmipc__blake2s_t *s, const uint8_t block[64]) {
  uint32_t m[16], v[16];
  for (int i = 0; i < 16; i++)
    m[i] = load32(block + 4 * i);
  for (int i = 0; i < 8; i++) {
    v[i] = s->h[i];
    v[i + 8] = blake2s_iv[i];
  }
  v[12] ^= s->t[0];
  v[13] ^= s->t[1];
  v[14] ^= s->f[0];
  v[15] ^= s->f[1];
  /* Unrolled, the sigma indices become constants and m stays in
   * registers: about 3x faster than the rolled loop, and MACs are on every
   * first open's path. */
#pragma GCC unroll 10
  for (int r = 0; r < 10; r++) {
    const uint8_t *z = blake2s_sigma[r];
    G(0, 4, 8, 12, m[z[0]], m[z[1]]);
    G(1, 5, 9, 13, m[z[2]], m[z[3]]);
    G(2, 6, 10, 14, m[z[4]], m[z[5]]);
    G(3, 7, 11, 15, m[z[6]], m[z[7]]);
    G(0, 5, 10, 15, m[z[8]], m[z[9]]);
    G(1, 6, 11, 12, m[z[10]], m[z[11]]);
    G(2, 7, 8, 13, m[z[12]], m[z[13]]);
    G(3, 4, 9, 14, m[z[14]], m[z[15]]);
  }
  for (int i = 0; i < 8; i++)
    s->h[i] ^= v[i] ^ v[i + 8];
  /* m and v are functions of the key for the first block of a keyed hash. */
  wipe(m, sizeof(m));
  wipe(v, sizeof(v));
}
#undef G

/* The counter t is a 64-bit byte count split into two words; it counts the
 * bytes of the message (key block included) up to the end of this block. */
static void count(usmipc__blake2s_t *s, uint32_t n) {
  s->t[0] += n;
  if (s->t[0] < n)
    s->t[1]++;
}

void usmipc__blake2s_init(usmipc__blake2s_t *s, size_t outlen, const void *key,
                          size_t keylen) {
  /* Lengths are constants at every call site; a wrong one would compute a
   * different function or write past out, so stop instead. */
  if (outlen == 0 || outlen > USMIPC__BLAKE2S_MAX_OUT ||
      keylen > USMIPC__BLAKE2S_MAX_KEY || (key == NULL && keylen != 0))
    abort();
  memset(s, 0, sizeof(*s));
  for (int i = 0; i < 8; i++)
    s->h[i] = blake2s_iv[i];
  /* Parameter block word 0: digest length, key length, fanout 1, depth 1
   * (sequential mode); the other words are zero, so h[1..7] stay the IV. */
  s->h[0] ^= 0x01010000u ^ ((uint32_t)keylen << 8) ^ (uint32_t)outlen;
  s->outlen = outlen;
  if (keylen > 0) {
    /* A keyed hash starts with the key zero-padded to a whole block. */
    memcpy(s->buf, key, keylen);
    s->buflen = USMIPC__BLAKE2S_BLOCK;
  }
}

void usmipc__blake2s_update(usmipc__blake2s_t *s, const void *data,
                            size_t len) {
  const uint8_t *p = data;
  /* The last block must be compressed by final with the final flag set, so
   * a full buffer is compressed only once more input is known to follow:
   * hence `len > room` rather than `>=`. */
  while (len > 0) {
    size_t room = USMIPC__BLAKE2S_BLOCK - s->buflen;
    if (len <= room) {
      memcpy(s->buf + s->buflen, p, len);
      s->buflen += len;
      return;
    }
    memcpy(s->buf + s->buflen, p, room);
    p += room;
    len -= room;
    count(s, USMIPC__BLAKE2S_BLOCK);
    compress(s, s->buf);
    s->buflen = 0;
    /* Whole blocks with more input after them go straight from the input. */
    while (len > USMIPC__BLAKE2S_BLOCK) {
      count(s, USMIPC__BLAKE2S_BLOCK);
      compress(s, p);
      p += USMIPC__BLAKE2S_BLOCK;
      len -= USMIPC__BLAKE2S_BLOCK;
    }
  }
}

void usmipc__blake2s_final(usmipc__blake2s_t *s, void *out) {
  uint8_t digest[USMIPC__BLAKE2S_MAX_OUT];
  count(s, (uint32_t)s->buflen);
  s->f[0] = 0xFFFFFFFFu; /* last block; f[1] is for tree mode only */
  memset(s->buf + s->buflen, 0, USMIPC__BLAKE2S_BLOCK - s->buflen);
  compress(s, s->buf);
  for (int i = 0; i < 8; i++)
    for (int k = 0; k < 4; k++)
      digest[4 * i + k] = (uint8_t)(s->h[i] >> (8 * k));
  memcpy(out, digest, s->outlen);
  wipe(digest, sizeof(digest));
  wipe(s, sizeof(*s));
}

void usmipc__mac(uint8_t out[16], const uint8_t key[16], const void *data,
                 size_t len) {
  usmipc__blake2s_t s;
  usmipc__blake2s_init(&s, USMIPC__MAC_LEN, key, USMIPC__MAC_KEY_LEN);
  usmipc__blake2s_update(&s, data, len);
  usmipc__blake2s_final(&s, out); /* wipes s */
}

void usmipc__mac_keyed_init(usmipc__blake2s_t *s, const uint8_t key[16]) {
  usmipc__blake2s_init(s, USMIPC__MAC_LEN, key, USMIPC__MAC_KEY_LEN);
  /* Compress the key block now rather than when input follows, as update
   * would: a state copied from here needs one compression per message. */
  count(s, USMIPC__BLAKE2S_BLOCK);
  compress(s, s->buf);
  s->buflen = 0;
}

void usmipc__mac_keyed(uint8_t out[16], const usmipc__blake2s_t *keyed,
                       const void *data, size_t len) {
  /* A keyed hash of an empty message compresses the key block as the last
   * block, with the final flag: not what the precompressed state holds. */
  if (len == 0)
    abort();
  usmipc__blake2s_t s = *keyed;
  usmipc__blake2s_update(&s, data, len);
  usmipc__blake2s_final(&s, out); /* wipes s */
}

int usmipc__ct_equal(const void *a, const void *b, size_t n) {
  const volatile uint8_t *x = a, *y = b;
  uint8_t d = 0;
  /* No early exit: every byte is read and the differences are ORed. */
  for (size_t i = 0; i < n; i++)
    d |= x[i] ^ y[i];
  /* 1 when d is 0 and 0 otherwise, without a branch on d: (d - 1) >> 8 has
   * its low bit set only when d - 1 wrapped below zero. */
  return (int)((((uint32_t)d - 1) >> 8) & 1);
}
