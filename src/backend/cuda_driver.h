/* The CUDA driver API's types and constants that usmipc uses, declared with
 * cuda.h's documented layouts (CUDA 12/13 driver API) so that nothing here
 * needs the CUDA toolkit to build: the backend (cuda.c) and the --raw
 * benchmark peer (bench/c/ipc/peer_cuda.c) load the driver with dlopen and
 * share these declarations. Internal: not installed. */
#ifndef USMIPC_BACKEND_CUDA_DRIVER_H
#define USMIPC_BACKEND_CUDA_DRIVER_H

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct {
  char reserved[64];
} CUipcEventHandle;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct {
  char reserved[64];
} CUipcMemHandle;
typedef struct {
  char bytes[16];
} CUuuid;
typedef struct {
  int type; /* CUmemLocationType */
  int id;
} CUmemLocation;
typedef struct {
  int type;                 /* CUmemAllocationType */
  int requestedHandleTypes; /* CUmemAllocationHandleType */
  CUmemLocation location;
  void *win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
} CUmemAllocationProp;
typedef struct {
  CUmemLocation location;
  int flags; /* CUmemAccess_flags */
} CUmemAccessDesc;

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_SUPPORTED = 801,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_ALREADY_MAPPED = 208,
  CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704,
  CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41,
  CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY = 83,
  CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102,
  CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103,
  CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
  CU_POINTER_ATTRIBUTE_BUFFER_ID = 7,
  CU_POINTER_ATTRIBUTE_IS_MANAGED = 8,
  CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
  CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10,
  CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11,
  CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12,
  CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID = 20, /* CUDA 11.7+ drivers */
  CU_MEMORYTYPE_HOST = 1,
  CU_MEMORYTYPE_DEVICE = 2,
  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1,
  CU_MEM_HANDLE_TYPE_FABRIC = 8,
  CU_MEM_ALLOCATION_TYPE_PINNED = 1,
  CU_MEM_LOCATION_TYPE_DEVICE = 1,
  CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,
  CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0,
  CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1,
  CU_MEM_ATTACH_GLOBAL = 1,
  CU_MEMHOSTALLOC_PORTABLE = 1,
  CU_STREAM_NON_BLOCKING = 1,
  CU_EVENT_DISABLE_TIMING = 0x2,
  CU_EVENT_INTERPROCESS = 0x4,
  CUDA_ERROR_NOT_READY = 600,
};

#endif
