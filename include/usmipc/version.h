#ifndef USMIPC_VERSION_H
#define USMIPC_VERSION_H

#define USMIPC_VERSION_MAJOR 0
#define USMIPC_VERSION_MINOR 2
#define USMIPC_VERSION_PATCH 0
#define USMIPC_VERSION_STRING "0.2.0"
#define USMIPC_VERSION_HEX                                                     \
  ((USMIPC_VERSION_MAJOR << 16) | (USMIPC_VERSION_MINOR << 8) |                \
   USMIPC_VERSION_PATCH)

#endif /* USMIPC_VERSION_H */
