/* colibri/csrc/npy.h: cheap checks of NumPy arrays through NumPy's C API, for calls made many
 * times per decode step (a typed memoryview goes through the buffer protocol: format
 * strings, ~1 us per array).
 *
 * NumPy's headers include <complex.h>, whose macro I would rename every field or variable
 * called I (the expert intermediate size) in the code that follows: it is undefined here.
 */
#ifndef COLIBRI_NPY_H
#define COLIBRI_NPY_H

#include <Python.h>
#include <numpy/arrayobject.h>

#ifdef I
#undef I
#endif

/* NumPy's C API table for this module; -1 with a Python error set if NumPy is missing. */
static int colibri_npy_import(void)
{
    if (_import_array() < 0)
        return -1;
    return 0;
}

/* The data of a, when a is an ndarray of float32 in native byte order, aligned, C-contiguous,
 * of ndim dimensions (and writable if asked), its shape copied to dims; else NULL (no error
 * set: the caller raises, naming what it expected). */
static float *colibri_f32_array(PyObject *a, int ndim, int writable, Py_ssize_t *dims)
{
    PyArrayObject *arr;
    int i;
    if (!PyArray_Check(a))
        return NULL;
    arr = (PyArrayObject *)a;
    if (PyArray_TYPE(arr) != NPY_FLOAT32 || PyArray_NDIM(arr) != ndim
            || !PyArray_ISNOTSWAPPED(arr))
        return NULL;
    if (writable ? !PyArray_ISCARRAY(arr) : !PyArray_ISCARRAY_RO(arr))
        return NULL;
    for (i = 0; i < ndim; i++)
        dims[i] = PyArray_DIM(arr, i);
    return (float *)PyArray_DATA(arr);
}

/* The data of a, when a is an ndarray holding a KV cache plane: float32 (*fmt = 0, the
 * weight format codes of types.h), float16 (1) or uint16 bf16 bits (2), native byte order,
 * aligned, C-contiguous, of ndim dimensions (writable if asked), its shape in dims; else
 * NULL (no error set). */
static void *colibri_kv_array(PyObject *a, int ndim, int writable, Py_ssize_t *dims, int *fmt)
{
    PyArrayObject *arr;
    int i, t;
    if (!PyArray_Check(a))
        return NULL;
    arr = (PyArrayObject *)a;
    t = PyArray_TYPE(arr);
    *fmt = t == NPY_FLOAT32 ? 0 : t == NPY_FLOAT16 ? 1 : t == NPY_UINT16 ? 2 : -1;
    if (*fmt < 0 || PyArray_NDIM(arr) != ndim || !PyArray_ISNOTSWAPPED(arr))
        return NULL;
    if (writable ? !PyArray_ISCARRAY(arr) : !PyArray_ISCARRAY_RO(arr))
        return NULL;
    for (i = 0; i < ndim; i++)
        dims[i] = PyArray_DIM(arr, i);
    return PyArray_DATA(arr);
}

/* The data pointer of an ndarray the caller made itself (known dtype and layout). */
static void *colibri_array_data(PyObject *a)
{
    return PyArray_DATA((PyArrayObject *)a);
}

#endif /* COLIBRI_NPY_H */
