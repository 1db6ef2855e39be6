// A 300 MB read (AVX-512 loads, a prefetch 4 KB ahead) on 4 KB pages and on 2 MB pages, alternated.
// gcc -O2 -mavx512f read_bandwidth.c -o read_bandwidth && taskset -c 1 ./read_bandwidth
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
__attribute__((noinline)) float rd(const float*a,size_t n){
  __m512 s0=_mm512_setzero_ps(),s1=s0,s2=s0,s3=s0;
  for(size_t i=0;i<n;i+=64){
    _mm_prefetch((const char*)(a+i+1024),_MM_HINT_T0);
    s0=_mm512_add_ps(s0,_mm512_loadu_ps(a+i));s1=_mm512_add_ps(s1,_mm512_loadu_ps(a+i+16));
    s2=_mm512_add_ps(s2,_mm512_loadu_ps(a+i+32));s3=_mm512_add_ps(s3,_mm512_loadu_ps(a+i+48));}
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0,s1),_mm512_add_ps(s2,s3)));}
float* mk(size_t bytes,int huge){void*p=aligned_alloc(1<<21,bytes); if(huge)madvise(p,bytes,MADV_HUGEPAGE); else madvise(p,bytes,MADV_NOHUGEPAGE); memset(p,1,bytes);return p;}
int main(){size_t n=300*1024*1024/4;float*a=mk(n*4,0);float*b=mk(n*4,1);
 system("grep AnonHuge /proc/meminfo");
 for(int r=0;r<6;r++){double t=now();volatile float x=rd(a,n);double r0=now()-t;
  t=now();x=rd(b,n);double r1=now()-t;
  printf("4k %.2f GB/s  2M %.2f\n",n*4/r0/1e9,n*4/r1/1e9);}
}
